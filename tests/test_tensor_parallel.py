"""Tensor parallelism on the CPU (gloo, 2 ranks): each rank reads its slices, TP = 2 computes TP = 1's logits, and
serves the same tokens through the gateway; a rank that dies fails the requests in flight and the health."""
import os
import signal
import time

import grpc
import numpy as np
import pytest
import torch
from engine_factory import make_engine

from specdec.models.loader import dummy_tensors, load_model
from specdec.models.tensor_parallel import TensorParallel, local_config, shard_of, take
from specdec.sampling_params import SamplingParams
from specdec_tools.tiny import make_tiny
from verifier_service.executor import Executor
from verifier_service.model_runner import ModelRunner
from verifier_service.rank_group import RankSpec
from verifier_service.sequence import Sequence

pytestmark = pytest.mark.timeout(300)
SIZES = dict(num_blocks=64, block_size=4, max_seqs=4, max_drafts=3, max_batched_tokens=64)

CASES = {   # family, make_tiny overrides, expert layout
    "qwen3_5-odd-vocab": ("qwen3_5", {}, "fused"),                      # vocab 257: padded to 258 over 2 ranks
    "qwen3_5-tied-one-kv-head": ("qwen3_5", dict(num_key_value_heads=1, tie_word_embeddings=True), "fused"),
    "qwen3_5_moe-per-expert": ("qwen3_5_moe", {}, "per_expert"),
    "qwen3_next": ("qwen3_next", {}, "fused"),                        # fused in_proj_qkvz / in_proj_ba
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case_dir(request, tmp_path_factory):
    family, overrides, layout = CASES[request.param]
    return make_tiny(tmp_path_factory.mktemp(request.param), family=family, overrides=overrides, seed=5,
                     expert_layout=layout, progress=False)


def test_each_rank_loads_its_slices(case_dir):
    """A rank's tensors are exactly its shard of the full ones (read by slice, no rank holds the whole)."""
    full = load_model(case_dir)
    weights = dict(full.model.state_dict())
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        part = load_model(case_dir, tp=tp)
        assert part.mtp_weights == {}                  # left to the drafter service
        sharded = 0
        for name, t in part.model.state_dict().items():
            shard = shard_of(full.config, tp, name)
            sharded += shard is not None
            assert torch.equal(t, take(weights[name], shard)), name
        assert sharded >= 8
        assert part.model.embed_tokens.weight.shape[0] == -(-full.config.vocab_size // 2)


def test_four_ranks_split_heads_and_copy_kv_heads(tiny_dir):
    """8 q heads, 2 kv heads over 4 ranks: q heads 2 a rank, kv head 0 on ranks 0-1 and 1 on ranks 2-3; the rows
    follow (q_proj holds query and gate of a head side by side)."""
    import dataclasses
    config = dataclasses.replace(load_model(tiny_dir).config, num_attention_heads=8, num_key_value_heads=2,
                                 linear_num_key_heads=4, linear_num_value_heads=8)
    d = config.head_dim
    assert [TensorParallel(r, 4).kv_heads(config) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2),
                                                                        range(1, 2)]
    tp = TensorParallel(2, 4)
    assert shard_of(config, tp, "layers.3.self_attn.q_proj.weight").rows == [range(4 * 2 * d, 6 * 2 * d)]
    assert shard_of(config, tp, "layers.3.self_attn.k_proj.weight").rows == [range(d, 2 * d)]
    assert shard_of(config, tp, "layers.3.self_attn.o_proj.weight").rows == [range(4 * d, 6 * d)]
    assert shard_of(config, tp, "layers.3.self_attn.o_proj.weight").dim == 1
    assert shard_of(config, tp, "layers.0.input_layernorm.weight") is None


def test_local_config_refuses_what_does_not_split(tiny_dir):
    full = load_model(tiny_dir).config
    with pytest.raises(ValueError, match="num_attention_heads: 4 does not split over 3"):
        local_config(full, TensorParallel(0, 3))
    assert local_config(full, TensorParallel(1, 2)).linear_num_value_heads == full.linear_num_value_heads // 2


PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 200, 13], [64, 8, 100, 3, 250]]


def _steps(executor: Executor):
    """A prefill of both prompts (every logit), then a verify step of one token + 3 drafts each, the second
    replaying 2 accepted drafts: (hidden, logits) of each step."""
    seqs = [Sequence(i, list(p), len(p)) for i, p in enumerate(PROMPTS)]
    out = [tuple(t.clone() for t in executor.forward(seqs, PROMPTS, logits="all"))]
    for s in seqs:
        s.num_cached = len(s.token_ids)
    out.append(tuple(t.clone() for t in executor.forward(seqs, [[7, 8, 9, 10], [11, 12, 13, 14]], [3, 3],
                                                          logits="all")))
    for s in seqs:   # 2 of the 3 drafts accepted: GDN replays them from its ring, KV keeps their rows
        s.num_cached += 3
        s.gdn_read_offset = 2
    out.append(tuple(t.clone() for t in executor.forward(seqs, [[20, 21, 22, 23], [24, 25, 26, 27]], [3, 3],
                                                          logits="all")))
    for s in seqs:
        executor.blocks.release(s)
    return out


def test_two_ranks_compute_the_logits_of_one(case_dir):
    """fp32: TP = 2 (gloo) gives TP = 1's hidden states and logits within 1e-5 of their scale (the partial sums
    add in another order), through prefill and verify steps."""
    one = Executor(ModelRunner(load_model(case_dir), **SIZES))
    # a message of 32 words: the prefill's plan takes the second broadcast
    two = Executor.build_parallel(RankSpec(str(case_dir), 2, runner=SIZES, message_size=32))
    try:
        for (h1, l1), (h2, l2) in zip(_steps(one), _steps(two)):
            assert l2.shape == l1.shape and h2.shape == h1.shape
            assert (l2 - l1).abs().max().item() <= 1e-5 * l1.abs().max().item()
            assert (h2 - h1).abs().max().item() <= 1e-5 * h1.abs().max().item()
    finally:
        two.close()


def test_dummy_weights_need_no_files(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    loaded = load_model(tmp_path, load_format="dummy")
    ranks = [load_model(tmp_path, load_format="dummy", tp=TensorParallel(r, 2)) for r in range(2)]
    norm, gate = "layers.0.input_layernorm.weight", "layers.0.mlp.gate_proj.weight"
    weights = [dict(r.model.state_dict()) for r in ranks]
    assert not torch.equal(weights[0][gate], weights[1][gate])     # each rank its own shard ...
    routers = {}
    for family in ("qwen3_5_moe",):                                # ... and the same replicated tensors
        moe = make_tiny(tmp_path / family, family=family, weights=False)
        routers[family] = [load_model(moe, load_format="dummy", tp=TensorParallel(r, 2)).model.layers[0].mlp.gate
                           .weight for r in range(2)]
        assert torch.equal(*routers[family])
    assert torch.equal(weights[0][norm], weights[1][norm])
    assert loaded.model.layers[0].linear_attn.in_proj_qkv.weight.std().item() == pytest.approx(0.02, rel=0.2)
    part = load_model(tmp_path, load_format="dummy", tp=TensorParallel(1, 2))
    rows = [m.model.layers[0].mlp.gate_proj.weight.shape[0] for m in (part, loaded)]
    assert rows[0] == rows[1] // 2
    a_log = dummy_tensors({"layers.0.linear_attn.A_log": torch.Size([64])}, torch.float32, "cpu")
    assert 0.0 <= a_log["layers.0.linear_attn.A_log"].min() and a_log["layers.0.linear_attn.A_log"].max() <= np.log(16)
    with pytest.raises(ValueError, match="load format must be one of"):
        load_model(tmp_path, load_format="pt")


# ---- through the gateway -------------------------------------------------------------------
LONG = list(range(20, 60))   # 40 tokens: the verifier keeps its state at token 31 (its last whole block of 16)
STACK_PROMPTS = [[5, 17, 3, 99, 42], [64, 8, 100, 3, 7, 7, 1, 250], [300, 301, 302, 5, 17, 3], LONG, LONG + [3, 4]]
SEEDED = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.3)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("tp-stack"), overrides={"vocab_size": 400}, tokenizer=True,
                         seed=2, progress=False))


@pytest.fixture(scope="module")
def expected(mtp_dir):
    """Greedy and seeded tokens of one process, plain decoding: what a TP = 2 stack must serve, any drafter."""
    engine = make_engine(load_model(mtp_dir), num_blocks=512)
    greedy = engine.generate(STACK_PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    seeded = engine.generate(STACK_PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=40 + i,
                                                            **SEEDED) for i in range(len(STACK_PROMPTS))])
    return greedy, seeded


def tp_stack(model_dir, tmp_path, drafter):
    from specdec_tools.local_stack import LocalStack, StackConfig
    stack = LocalStack(StackConfig(model=model_dir, drafter=drafter, num_drafts=3, port=0, log_dir=str(tmp_path),
                                   verifier_args=("--tensor-parallel-size", "2"), startup_timeout_s=180))
    stack.start()
    return stack


def generate(stub, ids, max_tokens=MAX_TOKENS, drafted=None, cached=None, **sampling):
    from specdec.rpc.v1 import gateway_pb2
    request = gateway_pb2.GenerateRequest(prompt_token_ids=ids, sampling=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **sampling))
    replies = list(stub.Generate(request, timeout=120))
    if drafted is not None:
        drafted.append(replies[-1].usage.draft_tokens)
    if cached is not None:
        cached.append(replies[-1].usage.cached_tokens)
    return [t for r in replies for t in r.token_ids]


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_gateway_serves_tp1_tokens_over_two_ranks(mtp_dir, expected, tmp_path, drafter):
    from specdec.rpc.v1 import gateway_pb2_grpc
    stack = tp_stack(mtp_dir, tmp_path, drafter)
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            greedy, seeded, drafted, cached = *expected, [], []
            assert [generate(stub, ids, drafted=drafted, cached=cached) for ids in STACK_PROMPTS] == greedy
            assert drafter == "ngram" or min(drafted) > 0   # the MTP head drafted for every request
            assert cached == [0, 0, 0, 0, 31]               # the prefix cache over two ranks: LONG's state resumed
            assert [generate(stub, ids, seed=40 + i, **SEEDED) for i, ids in enumerate(STACK_PROMPTS)] == seeded
        log = (tmp_path / "verifier.log").read_text()
        assert "tensor parallel: 2 ranks joined" in log and "rank 1 of 2 ready" in log
        assert "the drafter lost its hidden states" not in log   # the drafter service resumed LONG's prefix too
    finally:
        stack.stop()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in open(
                    f"/proc/{entry}/cmdline").read().replace("\0", " "):
                out.append(int(entry))
    return out


def test_a_dead_rank_fails_requests_in_flight_and_health(mtp_dir, tmp_path):
    from specdec.rpc.health_probe import is_serving
    from specdec.rpc.v1 import gateway_pb2_grpc
    stack = tp_stack(mtp_dir, tmp_path, "none")
    try:
        (rank1,) = _children(stack.procs["verifier"].pid)
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            from specdec.rpc.v1 import gateway_pb2
            stream = stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=STACK_PROMPTS[0], sampling=
                                   gateway_pb2.SamplingParams(max_tokens=3000, ignore_eos=True)), timeout=120)
            next(stream)                       # it is decoding
            os.kill(rank1, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as failed:
                for _ in stream:
                    pass
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "tensor-parallel rank 1" in failed.value.details()
        deadline = time.monotonic() + 10
        while is_serving(f"127.0.0.1:{stack.ports['verifier']}", timeout=2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_serving(f"127.0.0.1:{stack.ports['verifier']}", timeout=2)
        assert stack.procs["verifier"].wait(timeout=20) == 3      # then it exits, for a restart with every rank
        assert "the requests in flight failed; exiting" in (tmp_path / "verifier.log").read_text()
    finally:
        stack.stop()


def test_in_process_drafter_refused_beside_ranks(mtp_dir):
    from verifier_service.builder import VerifierConfig, build_engine
    with pytest.raises(ValueError, match="in-process mtp drafter cannot run beside tensor-parallel ranks"):
        build_engine(VerifierConfig(mtp_dir, tensor_parallel_size=2, in_process_drafter="mtp"), lambda *a: None)


def test_step_message_round_trip():
    """The packed step message gives back the plan (block tables cut to the columns in use) and the cache ops."""
    from specdec.models.batch_staging import StepPlan
    from verifier_service.block_manager import CacheOps
    from verifier_service.step_message import StepMessage
    plan = StepPlan.from_lists([[5, 6, 7, 8], [9]], [12, 3], [[4, 2, 7, 1], [3]], [1, 0], gdn_read_offsets=[2, 0],
                               num_drafts=[3, 0], logits=[4, 1])
    plan.block_tables = np.pad(plan.block_tables, ((0, 0), (0, 6)))   # as wide as the executor's rows
    plan.replays_on_device = 3                                          # every rank picks the same graph
    ops = CacheOps([1], [(9, 2)], [(4, 5), (6, 7)], [(3, 10)])
    back = StepMessage.unpack(StepMessage(plan, ops, True).pack())
    assert back.ops == ops and back.share_inputs and back.plan.replays_on_device == 3
    for name in ("token_ids", "seq_lens", "start_positions", "table_lens", "gdn_slots", "gdn_read_offsets",
                 "num_drafts", "logits_per_seq"):
        assert np.array_equal(getattr(back.plan, name), getattr(plan, name)), name
    assert np.array_equal(back.plan.block_tables, plan.block_tables[:, :4])
    assert StepMessage.unpack(StepMessage(None, CacheOps(), False).pack()).plan is None


def test_spec_device_of_each_rank():
    assert RankSpec("m", 2, device="cuda").device_of(1) == "cuda:1"
    assert RankSpec("m", 2).device_of(1) == "cpu"


STUCK_SCRIPT = """
import os, signal, sys, time
import verifier_service.rank_group as rank_group
from verifier_service.executor import Executor
rank_group.STUCK_AFTER_S = 1.0
executor = Executor.build_parallel(rank_group.RankSpec(sys.argv[1], 2, runner=dict(
    num_blocks=16, block_size=4, max_seqs=2)))
executor.ranks.watch()   # as server.serve does
os.kill(executor.ranks.processes[0].pid, signal.SIGKILL)
time.sleep(30)     # no step raises RankLost: the watcher must end this process
"""


def test_a_rank_lost_while_no_step_notices_ends_the_verifier(tiny_dir, tmp_path):
    """Rank 0 that cannot learn of a lost rank from a step (idle here; in NCCL it would wait forever) exits with 3."""
    import subprocess
    import sys
    script = tmp_path / "stuck.py"
    script.write_text("if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in STUCK_SCRIPT.splitlines()))
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(tiny_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert time.monotonic() - started < 25
    assert "tensor-parallel rank 1" in done.stderr and "stuck waiting for it" in done.stderr


DEAD_START_SCRIPT = """
import sys, time
from verifier_service.rank_group import RankGroup, RankLost, RankSpec
sys.path.insert(0, sys.argv[2])   # an empty kernels.py first on the path: the spawned rank cannot import kernels/
started = time.monotonic()
try:
    RankGroup(RankSpec(sys.argv[1], 2, runner=dict(num_blocks=16, block_size=4, max_seqs=2)))
except RankLost as e:
    print(f"RankLost after {time.monotonic() - started:.1f} s: {e}")
"""


def test_a_rank_that_dies_starting_is_reported_not_waited_for(tiny_dir, tmp_path):
    """Rank 0 waits for the others at the store while checking they live: a rank dead before it joins raises
    RankLost within seconds (the store alone would wait START_TIMEOUT_S, 10 minutes)."""
    import subprocess
    import sys
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "kernels.py").write_text("")
    script = tmp_path / "dead_start.py"
    script.write_text("if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in
                                                              DEAD_START_SCRIPT.splitlines()))
    done = subprocess.run([sys.executable, str(script), str(tiny_dir), str(tmp_path / "shadow")],
                          capture_output=True, text=True, timeout=60)
    assert "RankLost after" in done.stdout and "tensor-parallel rank 1" in done.stdout, done.stderr[-2000:]
    assert float(done.stdout.split("after ")[1].split(" s")[0]) < 20


@pytest.mark.gpu
def test_two_gpus_with_graphs_and_overlap_match_one(tmp_path, cuda):
    """NCCL collectives inside the CUDA graphs, overlapped steps sharing rank 0's inputs: TP = 2 computes TP = 1's
    logits (fp32) and an engine over the two ranks decodes TP = 1's greedy tokens, prompts of mixed lengths. (One
    group per process: the engine's executor also runs the logit steps.)"""
    from verifier_service.builder import VerifierConfig, build_engine
    if torch.cuda.device_count() < 2:
        pytest.fail("needs 2 GPUs: run on nvidia-h100-x2 / nvidia-h200-x2")
    model = make_tiny(tmp_path / "m", family="qwen3_next", overrides={"vocab_size": 400}, seed=3, progress=False)
    prompts = [[5, 17, 3, 99, 42], list(range(40, 90)), [12]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tokens, logits = {}, {}
    for size in (1, 2):
        engine = build_engine(VerifierConfig(str(model), device="cuda", num_drafts=3, max_running=4,
                                             max_context=256, tensor_parallel_size=size))
        try:
            assert engine.executor.runner.graphs is not None
            assert (engine.executor.runner.model.tp.one_shot is not None) == (size == 2)   # (--all-reduce one-shot)
            logits[size] = _steps(engine.executor)
            tokens[size] = engine.generate(prompts, params)
        finally:
            engine.executor.close()
    for (h1, l1), (h2, l2) in zip(logits[1], logits[2]):
        assert (l2 - l1).abs().max().item() <= 1e-4 * l1.abs().max().item()
    assert tokens[1] == tokens[2]


def _set_up_one_shot(rank: int, port: int, results) -> None:
    """A rank of test_one_shot_is_set_up_on_every_rank_or_on_none: rank 0's allocation fails, rank 1's works."""
    import torch.distributed as dist

    from specdec.models.tensor_parallel import OneShotAllReduce
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    host = dist.new_group(backend="gloo")
    joined = []

    def allocate(self, max_bytes, dtype, device):
        if rank == 0:
            raise RuntimeError("out of memory (planted)")
        self.dtype = dtype
    OneShotAllReduce.__init__ = allocate
    OneShotAllReduce.join = lambda self: joined.append(rank)   # would be a rendezvous only one rank reaches
    made = OneShotAllReduce.set_up(1 << 20, torch.bfloat16, torch.device("cpu"), rank, host)
    half = OneShotAllReduce.set_up(1 << 20, torch.float16, torch.device("cpu"), rank, host)
    results.put((rank, made is None, joined, half is None))
    dist.destroy_process_group()


def test_one_shot_is_set_up_on_every_rank_or_on_none():
    """A rank whose one-shot buffer cannot be allocated makes every rank sum over NCCL instead (the others must
    not join a rendezvous it never reaches, nor sum one way while it sums the other); fp16 never takes it."""
    import multiprocessing as mp

    from specdec.transport.host import free_port
    context, port = mp.get_context("spawn"), free_port()
    results = context.Queue()
    ranks = [context.Process(target=_set_up_one_shot, args=(r, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = sorted(results.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(30)
    assert got == [(0, True, [], True), (1, True, [], True)]
