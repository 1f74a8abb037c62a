"""GPU: once every service of a stack reports SERVING, no request compiles a Triton kernel (issue 34, (10)).

Triton compiles a variant of a kernel the first time a process launches it with a new specialisation: other
constexprs (paged attention's query tile and split count, the norms' rows per program, conv1d's token tile, the
GDN kernel's pipelining, the sampler's mode), an integer argument that is 1 or divisible by 16, a pointer that is
or is not 16-byte aligned. A compile stalls every running request of that process: on a fresh stack the first
burst of 16 requests waited for them. The warm-up must compile every variant a step can reach before health says
SERVING, in the verifier (verifier_service/warm_up.py) AND in the drafter service (drafter_service/mtp/warm_up.py).

How compiles are counted (Triton 3.6, triton/runtime/jit.py JITFunction._do_compile): `knobs.runtime.jit_cache_hook`
is called once per in-memory cache miss of a JITFunction (a new specialisation in this process, whether the binary
then comes from Triton's disk cache or is compiled), before `jit_post_compile_hook`; autotuned kernels (fla-core)
come through the same path once per config they try. The services run in their own processes, so a
sitecustomize.py put first on their PYTHONPATH installs the hook there and appends one JSON line per miss to a
log (time, pid, service, kernel, its specialisation). Independently, TRITON_CACHE_DIR is a fresh folder: a kernel
compiled (not loaded) after SERVING leaves a new entry there, whatever process did it. Either counts as a failure.

Workload after SERVING (the issue's: one request at batch 1, then bursts): for each batch bucket B up to
max_running, B requests at once, greedy and seeded-sampled alternately, prompts of lengths that reach every
attention query tile and the prefill / mixed buckets and beyond them (chunks longer than the largest prefill
bucket run eagerly), then one burst of max_running long prompts (mixed steps), one request with logprobs (the
synchronous steps and the drafter's catch-up of several prompts at once) and one with a repetition penalty.
"""
import json
import os
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]

MAX_RUNNING = 16
K = 3
PROMPT_LENGTHS = (1, 3, 5, 9, 17, 33, 70, 128, 200, 257, 300, 513)   # attention tiles 1..32, prefill / mixed / eager

HOOK = textwrap.dedent('''
    """Test-only (tests/test_gpu_warm_up.py): log every Triton JIT cache miss of this process."""
    import json, os, sys, time
    _log = os.environ.get("SPECDEC_TRITON_MISS_LOG")
    if _log:
        from triton import knobs

        def _miss(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            service = next((a for a in sys.argv if a in ("verifier", "drafter", "gateway")), sys.argv[0])
            line = {"t": time.time(), "pid": os.getpid(), "service": service,
                    "kernel": f"{fn.module}.{fn.name}", "variant": repr[:600]}
            with open(_log, "a") as f:
                f.write(json.dumps(line) + "\\n")
            return None   # never skip the compile

        knobs.runtime.jit_cache_hook = _miss
''')


@pytest.fixture
def counted_env(tmp_path, monkeypatch):
    """Children of this test (the stack's services) log their JIT misses and compile into a fresh cache."""
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    log, cache = tmp_path / "triton_misses.jsonl", tmp_path / "triton_cache"
    cache.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SPECDEC_TRITON_MISS_LOG", str(log))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    return log, cache


def misses_after(log: Path, since: float) -> list[dict]:
    if not log.exists():
        return []
    return [m for m in map(json.loads, log.read_text().splitlines()) if m["t"] >= since]


def cache_entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.exists() else set()


def kernel_names(cache: Path, entries: set[str]) -> list[str]:
    """The kernels of new cache entries (each entry holds <kernel>.json, <kernel>.cubin, ...)."""
    return sorted({f.stem for e in entries for f in (cache / e).glob("*.json") if not f.name.startswith("__grp__")})


def burst(address: str, requests: list[tuple[list[int], dict]]) -> list[str]:
    """Send every request at once; returns the errors (empty when all finished)."""
    from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
    errors: list[str] = []

    def one(ids, sampling):
        try:
            with grpc.insecure_channel(address) as channel:
                for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                        prompt_token_ids=ids, sampling=gateway_pb2.SamplingParams(**sampling)), timeout=300):
                    pass
        except grpc.RpcError as e:
            errors.append(f"{e.code().name}: {e.details()}")
    threads = [threading.Thread(target=one, args=r) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def prompt(length: int, salt: int, vocab: int) -> list[int]:
    return [(37 * j + 11 * salt + 1) % (vocab - 1) + 1 for j in range(length)]


def sampling(i: int, max_tokens: int = 24, **extra) -> dict:
    """Greedy and seeded top-p sampling alternately."""
    base = dict(max_tokens=max_tokens, ignore_eos=True)
    return {**base, **extra} if i % 2 == 0 else {**base, "temperature": 0.8, "top_p": 0.9, "seed": i, **extra}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_no_triton_compile_after_serving(tmp_path, cuda, counted_env, dtype):
    from specdec.demo import demo_model_dir
    from specdec_tools.local_stack import LocalStack, StackConfig
    from specdec.models.cuda_graph_runner import buckets_for
    from specdec.models.model_config import ModelConfig
    log, cache = counted_env
    model = os.environ.get("SPECDEC_WARM_UP_TEST_MODEL") or demo_model_dir()
    vocab = ModelConfig.from_folder(model).vocab_size
    context = max(PROMPT_LENGTHS) + 64
    (tmp_path / "logs").mkdir()
    stack = LocalStack(StackConfig(
        model=model, drafter="mtp", num_drafts=K, device="cuda", dtype=dtype, port=0, transport="cuda_ipc",
        verifier_args=("--max-running", str(MAX_RUNNING), "--max-context", str(context)),
        drafter_args=("--max-seqs", str(MAX_RUNNING), "--max-context", str(context)),
        log_dir=str(tmp_path / "logs"), startup_timeout_s=900))
    start = time.time()
    stack.start()
    serving = time.time()   # every service reports SERVING from here on
    before = cache_entries(cache)
    errors, phases = [], []
    try:
        def phase(name, requests):
            t = time.time()
            errors.extend(burst(stack.address, requests))
            phases.append((name, t, time.time()))

        phase("b1", [(prompt(16, 0, vocab), sampling(0))])
        for b in buckets_for(MAX_RUNNING):
            phase(f"burst {b}", [(prompt(PROMPT_LENGTHS[(b + i) % len(PROMPT_LENGTHS)], 100 * b + i, vocab),
                                  sampling(i)) for i in range(b)])
        phase("long prompts", [(prompt(PROMPT_LENGTHS[-1 - i % 3], 7000 + i, vocab), sampling(i))
                               for i in range(MAX_RUNNING)])
        phase("logprobs + penalty", [(prompt(70, 9000, vocab), sampling(0, logprobs=2)),
                                     (prompt(33, 9001, vocab), sampling(1, repetition_penalty=1.1))])
    finally:
        stack.stop()
    assert not errors, errors
    misses = misses_after(log, serving)
    compiled = kernel_names(cache, cache_entries(cache) - before)
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")}
    warm = [line for text in logs.values() for line in text.splitlines() if "warm-up" in line]
    where = {}
    for m in misses:
        phase_name = next((n for n, a, b in phases if a <= m["t"] <= b), "between phases")
        where.setdefault(f"{m['service']} | {phase_name} | {m['kernel']}", []).append(m["variant"])
    report = "\n".join(f"{k}: {len(v)} variant(s), e.g. {v[0][:300]}" for k, v in sorted(where.items()))
    assert log.exists(), "no JIT miss was logged at all: the sitecustomize hook did not load in the services"
    assert not misses and not compiled, (
        f"{len(misses)} Triton JIT misses after SERVING ({serving - start:.0f} s after start), new cache entries "
        f"for {compiled}:\n{report}\nwarm-up log lines: {warm}")
    assert any("warm-up" in line for line in logs.get("verifier.log", "").splitlines())
    assert any("mtp drafter warm-up" in line for line in logs.get("drafter.log", "").splitlines())
