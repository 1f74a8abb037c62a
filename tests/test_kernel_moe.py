"""MoE routed experts: the Triton kernels (per-pair GEMVs, scan kernels, grouped GEMMs) vs the torch reference,
kernel-level and whole-model (with the Triton routing of tests/test_kernel_moe_route.py).

CPU: the Triton paths under TRITON_INTERPRET=1; whole-model checks swap them into SparseMoE on the tiny qwen3_5_moe
and qwen3_next configs (fp32) and compare logits and greedy decoding. GPU (`-m gpu`): a Qwen3.5-MoE-like shape,
no host sync (torch's sync debug mode), and capture in a CUDA graph.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.moe import SharedExpert, experts_kernel, moe_experts, moe_experts_ref, triton_experts  # noqa: E402
from kernels.moe.routing import max_padded_rows, sort_pairs_by_expert  # noqa: E402
from kernels.moe_route import moe_route  # noqa: E402

triton_moe_decode = pytest.importorskip("kernels.moe.triton_moe_decode")
triton_moe_route = pytest.importorskip("kernels.moe_route.triton_moe_route")  # the whole-model swap
KERNELS = {name: triton_experts(name) for name in ("grouped", "decode", "scan")}


def make_moe(num_tokens, hidden, inter, num_experts, top_k, dtype=torch.float32, device="cpu", seed=0,
             skewed=False):
    """Random experts and a softmax top-k routing (renormalised); `skewed` routes most tokens to expert 0/1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skewed:
        logits[:, :2] += 4.0
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(gate_up), to(down), weights.to(device), ids.to(device)


CASES = {  # tokens, hidden, intermediate, experts, top_k, skewed
    "decode-1tok": (1, 40, 24, 5, 2, False),
    "verify-7tok": (7, 40, 24, 5, 2, False),
    "odd-33tok-top3": (33, 48, 40, 8, 3, False),
    "skewed-unused-experts": (20, 24, 16, 6, 2, True),
    "prefill-block64": (200, 16, 24, 4, 2, False),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_matches_reference(case, kernel):
    *shape, skewed = CASES[case]
    x, gate_up, down, weights, ids = make_moe(*shape, skewed=skewed, seed=len(case))
    want = moe_experts_ref(x, gate_up, down, weights, ids)
    got = KERNELS[kernel](x, gate_up, down, weights, ids)
    assert not got.isnan().any()
    assert (got - want).abs().max().item() <= 1e-5


def make_shared(num_tokens, hidden, width, seed=0, dtype=torch.float32, device="cpu"):
    """A shared expert's weights and gate logits (one negative, one large, ...)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * width, hidden, generator=gen) * hidden ** -0.5
    down = torch.randn(hidden, width, generator=gen) * width ** -0.5
    gate = (torch.tensor([-1.5, 0.3, 4.0, 0.0]).repeat(num_tokens)[:num_tokens, None])
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return to(gate), to(gate_up), to(down)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("form", ["weights", "output", "other-width"])
def test_shared_expert_matches_reference(kernel, form):
    """out = routed + sigmoid(g) · shared(x): the shared expert given as weights of the experts' width (the decode
    kernels run it as one more GEMV row), as its output, or as weights of another width (computed apart)."""
    x, gate_up, down, weights, ids = make_moe(3, 40, 24, 5, 2, seed=6)
    gate, s_gate_up, s_down = make_shared(3, 40, 24 if form != "other-width" else 20, seed=6)
    by_weights = SharedExpert(gate, gate_up=s_gate_up, down=s_down)
    shared = SharedExpert(gate, output=by_weights.computed(x)) if form == "output" else by_weights
    want = moe_experts_ref(x, gate_up, down, weights, ids, by_weights)
    got = KERNELS[kernel](x, gate_up, down, weights, ids, shared)
    assert (got - want).abs().max().item() <= 1e-5
    without = KERNELS[kernel](x, gate_up, down, weights, ids)
    expected = by_weights.computed(x) * torch.sigmoid(gate)
    assert (got - without - expected).abs().max().item() <= 1e-5
    # planted defect: the shared expert's gate logit of one token moved; its row (only) must change
    moved = SharedExpert(gate + torch.tensor([[0.0], [0.5], [0.0]]), gate_up=shared.gate_up, down=shared.down,
                         output=shared.output)
    diff = (KERNELS[kernel](x, gate_up, down, weights, ids, moved) - got).abs().amax(-1)
    assert diff[1] > 1e-3 and diff[0] == 0 and diff[2] == 0


def test_shared_expert_needs_weights_or_output():
    with pytest.raises(ValueError, match="either its output or both its weights"):
        SharedExpert(torch.zeros(1, 1))


def test_decode_kernels_fuse_only_a_plain_shared_expert_of_the_experts_width():
    _, gate_up, _, _, _ = make_moe(1, 40, 24, 5, 2)
    gate, s_gate_up, s_down = make_shared(1, 40, 24)
    assert triton_moe_decode.fuses(SharedExpert(gate, gate_up=s_gate_up, down=s_down), gate_up)
    assert not triton_moe_decode.fuses(SharedExpert(gate, gate_up=s_gate_up[:40], down=s_down[:, :20]), gate_up)
    assert not triton_moe_decode.fuses(SharedExpert(gate, gate_up=s_gate_up.half(), down=s_down.half()), gate_up)
    assert not triton_moe_decode.fuses(SharedExpert(gate, output=torch.zeros(1, 40)), gate_up)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,kernel", [
    (1, 8, 64, "decode"), (2, 8, 64, "decode"), (3, 8, 64, "scan"), (4, 8, 64, "scan"), (128, 8, 64, "scan"),
    (129, 8, 64, "grouped"), (1, 10, 512, "decode"), (8, 10, 512, "decode"), (12, 10, 512, "decode"),
    (13, 10, 512, "scan"), (16, 10, 512, "scan"), (8, 32, 4096, "decode"), (9, 32, 4096, "scan"),
    (1, 300, 512, "scan"), (103, 10, 512, "grouped"), (1, 2, 2, "decode"), (2, 1, 2, "scan")])
def test_dispatch_rule(num_tokens, top_k, num_experts, kernel):
    """A GEMV per pair for one token or P <= E / 4 (and P <= 256), the scan kernels up to 1024 pairs, then the
    grouped GEMMs (the crossovers measured: bench/README.md, "MoE decode")."""
    assert experts_kernel(num_tokens, top_k, num_experts) == kernel


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_fp16_matches_reference(kernel):
    x, gate_up, down, weights, ids = make_moe(9, 40, 24, 5, 2, dtype=torch.float16, seed=3)
    want = moe_experts_ref(x.float(), gate_up.float(), down.float(), weights, ids)
    got = KERNELS[kernel](x, gate_up, down, weights, ids)
    assert (got.float() - want).abs().max().item() <= 1e-2


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_parity_is_sharp_against_a_wrong_routing_weight(kernel):
    """A planted defect (one routing weight off by 10%) fails the same comparison."""
    x, gate_up, down, weights, ids = make_moe(7, 40, 24, 5, 2, seed=4)
    planted = weights.clone()
    planted[3, 1] *= 1.1
    got = KERNELS[kernel](x, gate_up, down, planted, ids)
    assert (got - moe_experts_ref(x, gate_up, down, weights, ids)).abs().max().item() > 1e-3


def test_decode_tiles_cover_edges():
    """Tiles that do not divide H or I (masked edges) and several K steps give the same result."""
    x, gate_up, down, weights, ids = make_moe(2, 40, 24, 5, 3, seed=7)
    want = moe_experts_ref(x, gate_up, down, weights, ids)
    tiles = triton_moe_decode.GemvTiles(block_n=16, block_k=16), triton_moe_decode.GemvTiles(block_n=32, block_k=8)
    got = triton_moe_decode.moe_experts_decode_triton(x, gate_up, down, weights, ids, tiles=tiles)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 2, 5, 16), (33, 3, 8, 16), (20, 2, 6, 4)])
def test_sort_pairs_by_expert_invariants(num_tokens, top_k, num_experts, block_m):
    _, _, _, _, ids = make_moe(num_tokens, 8, 8, num_experts, top_k, seed=num_tokens, skewed=True)
    sorted_pairs, block_experts = sort_pairs_by_expert(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    assert sorted_pairs.shape == (max_padded_rows(num_pairs, num_experts, block_m),)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "every pair exactly once"
    assert (sorted_pairs <= num_pairs).all()
    flat = ids.reshape(-1)
    for block, expert in enumerate(block_experts.tolist()):
        rows = sorted_pairs[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        if expert == num_experts:
            assert rows.numel() == 0, "a sentinel block holds no pair"
        else:
            assert (flat[rows] == expert).all() and rows.numel() > 0
    used = block_experts[block_experts < num_experts]
    assert used.tolist() == sorted(used.tolist()), "experts follow each other in id order"


def test_public_entry_point_dispatches_to_reference_on_cpu():
    args = make_moe(5, 16, 8, 4, 2, seed=5)
    assert torch.equal(moe_experts(*args), moe_experts_ref(*args))


# ---- whole model: tiny qwen3_5_moe / qwen3_next, fp32, Triton experts swapped into SparseMoE ------------------
@pytest.fixture(params=["qwen3_5_moe", "qwen3_next", "qwen3_next-equal-widths"])
def moe_model(request, tmp_path):
    """The tiny configs (shared expert 40 wide, experts 24: the kernels run it apart), and one whose shared expert
    has the experts' width, as the released models do: the kernels fuse it."""
    from hf_reference import make_hf_model

    from specdec.models.loader import load_model
    family, _, widths = request.param.partition("-")
    make_hf_model(family, tmp_path, seed=21, **({"shared_expert_intermediate_size": 24} if widths else {}))
    return load_model(tmp_path)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_model_logits_and_greedy_decoding_unchanged(moe_model, monkeypatch, kernel):
    """The Triton routing and experts (grouped, or per-pair GEMVs at every size) swapped into the tiny models."""
    from test_model_parity import PROMPTS, ragged_logits

    import specdec.models.mlp as mlp
    from verifier_service.executor import Executor
    from verifier_service.plain_generate import greedy_generate
    prompts = [p[:9] for p in PROMPTS]

    def run():
        _, logits = ragged_logits(moe_model, prompts)
        executor = Executor.build(moe_model, num_blocks=32, block_size=4, max_seqs=3)
        return logits, greedy_generate(executor, prompts, 8)

    want_logits, want_tokens = run()
    calls = []
    monkeypatch.setattr(mlp, "moe_experts", lambda *a: calls.append(1) or KERNELS[kernel](*a))
    monkeypatch.setattr(mlp, "moe_route", lambda *a: calls.append(2) or triton_moe_route.moe_route_triton(*a))
    got_logits, got_tokens = run()
    assert 1 in calls and 2 in calls, "the Triton routing and experts were not used"
    assert (got_logits - want_logits).abs().max().item() <= 1e-4
    assert got_tokens == want_tokens


# ---- GPU: Qwen3.5-35B-A3B-like MoE layer (hidden 2048, 256 experts, top 8, intermediate 512), bf16 ------------
def _gpu_case(num_tokens, seed=0):
    if not torch.cuda.is_available():
        pytest.fail("GPU test: run on the GPU machine")
    return make_moe(num_tokens, 2048, 512, 256, 8, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 2048])
def test_gpu_moe_shape_matches_reference_without_host_sync(num_tokens):
    """1 and 4 tokens take the per-pair GEMVs (the shared expert fused), 64 the scan kernels, 2048 the grouped GEMMs
    (256 experts)."""
    x, gate_up, down, weights, ids = _gpu_case(num_tokens)
    gate, s_gate_up, s_down = make_shared(num_tokens, 2048, 512, dtype=x.dtype, device="cuda")
    shared = SharedExpert(gate, gate_up=s_gate_up, down=s_down)
    want = moe_experts_ref(x.float(), gate_up.float(), down.float(), weights, ids,
                           SharedExpert(gate.float(), gate_up=s_gate_up.float(), down=s_down.float()))
    moe_experts(x, gate_up, down, weights, ids, shared)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = moe_experts(x, gate_up, down, weights, ids, shared)
        moe_route(torch.randn(num_tokens, 256, device="cuda"), 8, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * max(1.0, want.abs().max().item()), err


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("num_tokens", [3, 16, 100])
def test_gpu_each_kernel_matches_reference(kernel, num_tokens):
    x, gate_up, down, weights, ids = _gpu_case(num_tokens, seed=num_tokens)
    want = moe_experts_ref(x.float(), gate_up.float(), down.float(), weights, ids)
    got = KERNELS[kernel](x, gate_up, down, weights, ids)
    err = (got.float() - want).abs().max().item()
    assert err <= 2e-2 * max(1.0, want.abs().max().item()), err


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,kernel", [(2, "decode"), (48, "scan"), (200, "grouped")])
def test_gpu_moe_replays_in_a_cuda_graph(num_tokens, kernel):
    assert experts_kernel(num_tokens, 8, 256) == kernel
    x, gate_up, down, weights, ids = _gpu_case(num_tokens)
    gate, s_gate_up, s_down = make_shared(num_tokens, 2048, 512, dtype=x.dtype, device="cuda")
    static = [t.clone() for t in (x, weights, ids, gate)]
    run = lambda: moe_experts(static[0], gate_up, down, static[1], static[2],  # noqa: E731
                              SharedExpert(static[3], gate_up=s_gate_up, down=s_down))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x2, _, _, w2, ids2 = _gpu_case(num_tokens, seed=1)  # new tokens, routing and gates, same shapes
    gate2 = -gate
    for dst, src in zip(static, (x2, w2, ids2, gate2)):
        dst.copy_(src)
    graph.replay()
    want = moe_experts(x2, gate_up, down, w2, ids2, SharedExpert(gate2, gate_up=s_gate_up, down=s_down))
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_gpu_fast_path_greedy_equals_cpu_torch_path(tmp_path, family, cuda):
    """Tiny models in fp32 on the GPU (paged attention, fused norms, the MoE routing and expert kernels) decode the
    same greedy tokens as the CPU torch path, with chunked prefill."""
    from hf_reference import make_hf_model

    from specdec.models.loader import load_model
    from verifier_service.executor import Executor
    from verifier_service.plain_generate import greedy_generate
    make_hf_model(family, tmp_path, seed=31)
    prompts = [[5, 17, 3, 99, 42, 7, 1, 64, 2], [64, 8], list(range(10, 41))]

    def greedy(device):
        loaded = load_model(tmp_path, dtype="float32", device=device)
        executor = Executor.build(loaded, num_blocks=64, block_size=16, max_seqs=4, device=device)
        return greedy_generate(executor, prompts, 24, prefill_chunk=7)

    assert greedy("cuda") == greedy("cpu")


def test_bench_moe_rows_time_every_kernel_and_both_sides_of_the_boundary(monkeypatch):
    """`bench/kernels.py --moe --smoke`'s rows: routing, each expert kernel, and the block before, now, and now on
    the per-pair GEMVs and on the scan kernels (the decode / scan boundary), on the CPU under the interpreter."""
    import sys
    from pathlib import Path
    sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # after the packages: not kernels.py
    import moe_kernels
    import timing
    monkeypatch.setattr(timing, "REPS_CAP", 1)   # one call each: checks the script, not the speed
    rows = moe_kernels.moe_rows([1], torch.device("cpu"), 1e9, sweep=False, smoke=True)
    got = {(r["section"], r["impl"]) for r in rows}
    assert {("moe-route", "torch"), ("moe-route", "ours"), ("moe-experts", "grouped"), ("moe-experts", "decode"),
            ("moe-experts", "scan"), ("moe-block", "before"), ("moe-block", "now"), ("moe-block", "now, per-pair"),
            ("moe-block", "now, scan"), ("moe-experts", "fp8 grouped"), ("moe-experts", "fp8 decode"),
            ("moe-experts", "fp8 scan"), ("moe-experts", "fp8 ours")} <= got
    assert all(r["ms"] is not None and r["ms"] > 0 for r in rows)
