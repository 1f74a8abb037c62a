"""`specdec bench --preset long` (issue 38's workloads): lone long prompts (TTFT, prefill tokens/s, MFU) and the
interference run (decoders joined by one long prompt once they decode: their ITL before and while it prefills)."""
import math
from dataclasses import replace

import pytest

from specdec.demo import demo_model_dir
from specdec.models.loader import load_model
from specdec_tools.bench import presets, report
from specdec_tools.bench import workloads as wl
from specdec_tools.bench.environment import peak_flops
from specdec_tools.bench.latency import RequestTrace, interference
from specdec_tools.bench.traffic import ModelTraffic

pytestmark = pytest.mark.timeout(300)


def test_the_long_preset():
    long = presets.long_context()
    assert [w.prompt_tokens for w in long if not w.long_prompt and w.concurrency == 1] == list(presets.LONG_PROMPTS)
    assert [(w.concurrency, w.prompt_tokens) for w in long if w.concurrency == 64] == [presets.CROWD]
    mixed = [w for w in long if w.long_prompt]
    assert [w.drafter_label for w in mixed] == ["mtp@3.39", "none"]
    assert all(w.path == "gateway" and w.concurrency == 16 for w in long if w.long_prompt)
    w = mixed[0]
    assert w.prompt_lengths == [128] * 15 + [presets.INTERFERING_PROMPT] and w.name.endswith("/L16384")
    prompts = wl.prompts_for(w, 1000)
    assert [len(p) for p in prompts] == w.prompt_lengths
    assert prompts[:15] == wl.prompts_for(replace(w, long_prompt=0), 1000)[:15]   # the decoders' own prompts
    for bad in (dict(path="inproc"), dict(concurrency=1)):
        with pytest.raises(ValueError, match="long prompt"):
            replace(w, **bad)


def test_interference_of_known_traces():
    decoder = RequestTrace(sent=0.0, times=[0.1, 0.2, 0.3, 1.3, 1.4], counts=[1] * 5)
    other = RequestTrace(sent=0.0, times=[0.1, 0.25, 0.9, 1.0], counts=[1] * 4)
    long = RequestTrace(sent=0.3, times=[1.2, 1.25], counts=[1, 1])
    f = interference([decoder, other, long])
    assert f["long_ttft_ms"] == pytest.approx(900.0)
    before, during = f["decoders_itl_ms_before"], f["decoders_itl_ms_during"]
    assert before["gaps"] == 3 and before["max"] == pytest.approx(150.0)          # 0.1, 0.1 and 0.15 s
    assert during["gaps"] == 3 and during["max"] == pytest.approx(1000.0)         # 1.0, 0.65 and 0.1 s
    assert interference([decoder, RequestTrace(sent=0.3)]) == {"long_ttft_ms": None}


def test_prefill_flops_and_the_peak_they_are_measured_against():
    folder = demo_model_dir()
    traffic = ModelTraffic.from_checkpoint(folder, "float32")
    loaded = load_model(folder, dtype="float32", device="cpu")
    names = {n for n, _ in loaded.model.named_parameters()}
    linear = sum(p.numel() for n, p in loaded.model.named_parameters()
                 if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n and n.endswith(".weight"))
    assert names and traffic.active_params == linear
    c = loaded.config
    width = len(c.attention_layers) * c.num_attention_heads * c.head_dim
    t = 1000
    assert traffic.prefill_flops(t) == pytest.approx(2 * linear * t + 4 * width * t * (t + 1) / 2
                                                     + 2 * c.vocab_size * c.hidden_size)
    assert peak_flops({"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}) == 989e12
    assert peak_flops({"kind": "cuda", "name": "NVIDIA H100 PCIe"}) == 756e12
    assert peak_flops({"kind": "cpu", "name": "CPU x"}) is None


def test_an_interference_run_through_the_gateway_on_the_cpu():
    from specdec_tools.bench.gateway_path import GatewayBench
    w = wl.Workload("gateway", "none", 4, 16, 64, long_prompt=512)
    bench = GatewayBench(str(demo_model_dir()), "cpu", "float32")
    try:
        bench.ensure(w, [w])
        m = bench.run(w, wl.prompts_for(w, 4096), 120.0)
    finally:
        bench.close()
    f = m["interference"]
    assert m["prefills"] == 4 and not m["truncated"]
    assert f["long_ttft_ms"] > 0 and f["decoders_itl_ms_before"]["gaps"] >= 3 * 15
    assert f["decoders_itl_ms_during"]["gaps"] > 0
    record = {"results": [{"workload": w.to_json(), "metrics": m, "prefill": None}]}
    line, = report.long_context_lines(record["results"])
    assert line.startswith("interference (none, 3 decoders + one 512-token prompt): its TTFT") and "x)" in line
    assert math.isfinite(f["decoders_itl_ms_during"]["max"])


def test_a_workload_no_request_of_which_is_served_says_why_in_one_problem():
    """Prompts longer than the stack's context are refused: the result keeps the first refusal, and the checks
    report it as one line instead of a line per zero metric."""
    from specdec_tools.bench import checks
    from specdec_tools.bench.gateway_path import GatewayBench
    w = wl.Workload("gateway", "none", 2, 40, 8)
    bench = GatewayBench(str(demo_model_dir()), "cpu", "float32", service_args=(("--max-context", "32"), ()))
    try:
        bench.ensure(w, [w])
        m = bench.run(w, wl.prompts_for(w, 4096), 60.0)
    finally:
        bench.close()
    assert m["prefills"] == 0 and m["first_error"].startswith("RESOURCE_EXHAUSTED: prompt (40 tokens)")
    assert checks.check_result({"name": w.name, "workload": w.to_json(), "metrics": m, "bandwidth": {}}) == [
        f"{w.name}: no request was served: {m['first_error']}"]


def test_a_gateway_that_accepts_no_connection_is_named():
    """The clients connect before timing anything; a gateway that is not there fails the workload by name."""
    import grpc

    from specdec_tools.bench.gateway_clients import connect
    with grpc.insecure_channel("127.0.0.1:1") as channel, pytest.raises(RuntimeError, match="127.0.0.1:1 accepted no"):
        connect(channel, "127.0.0.1:1", timeout_s=0.5)


def fake_stacks(monkeypatch) -> list:
    """The StackConfig of every stack the gateway bench starts, none started for real."""
    from specdec_tools.bench import gateway_path
    started = []

    class FakeStack:
        def __init__(self, config):
            started.append(config)

        def start(self):
            pass

    monkeypatch.setattr(gateway_path, "LocalStack", FakeStack)
    return started


def test_a_prefill_chunk_reaches_the_verifier_with_a_budget_that_fits_it(monkeypatch):
    from specdec_tools.bench import gateway_path
    started = fake_stacks(monkeypatch)
    w = wl.Workload("gateway", "none", 16, 128, 512, long_prompt=4096)
    for chunk, expected in ((None, None), (2048, "2048")):
        bench = gateway_path.GatewayBench(str(demo_model_dir()), "cpu", "float32", prefill_chunk=chunk)
        bench.ensure(w, [w])
        args = list(started[-1].verifier_args)
        for flag in ("--prefill-chunk", "--mixed-prefill-chunk"):      # alone and beside decoders
            assert (args[args.index(flag) + 1] if flag in args else None) == expected
        assert int(args[args.index("--max-batched-tokens") + 1]) >= (chunk or 0) + 16
        bench.stack = None
        bench.logs.cleanup()


def test_service_defaults_leave_the_sizing_to_the_services(monkeypatch):
    """--service-defaults: no --max-running / --max-batched-tokens / --kv-blocks / --max-context for the verifier and
    no --max-seqs / --max-context for the drafter; --lone-prefill-chunk reaches the verifier either way."""
    from specdec_tools.bench import gateway_path
    started = fake_stacks(monkeypatch)
    w = wl.Workload("gateway", "mtp", 16, 128, 512, forced_length=3.39, long_prompt=4096)
    sizing = {"--max-running", "--max-batched-tokens", "--kv-blocks", "--max-context", "--max-seqs"}
    for defaults in (False, True):
        bench = gateway_path.GatewayBench(str(demo_model_dir()), "cpu", "float32", service_defaults=defaults,
                                          lone_prefill_chunk=512)
        bench.ensure(w, [w])
        args = set(started[-1].verifier_args) | set(started[-1].drafter_args)
        assert bool(args & sizing) != defaults
        verifier = list(started[-1].verifier_args)
        assert verifier[verifier.index("--lone-prefill-chunk") + 1] == "512"
        bench.stack = None
        bench.logs.cleanup()
