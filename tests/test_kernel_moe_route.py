"""MoE routing (softmax → top-k → renormalise): the one-launch Triton kernel vs the torch reference.

CPU: the Triton kernel under TRITON_INTERPRET=1. GPU (`-m gpu`): a Qwen3-Next-sized router (512 experts, top 10).
The whole-model checks with this routing swapped in are in tests/test_kernel_moe.py.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.moe_route import moe_route, moe_route_ref  # noqa: E402

triton_moe_route = pytest.importorskip("kernels.moe_route.triton_moe_route")


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (5, 6, 3), (3, 64, 8), (2, 10, 10)])
def test_route_matches_reference(num_tokens, num_experts, top_k, renormalise):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 3
    want_w, want_ids = moe_route_ref(logits, top_k, renormalise)
    got_w, got_ids = triton_moe_route.moe_route_triton(logits, top_k, renormalise)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids), "same experts, in descending order"
    assert (got_w - want_w).abs().max().item() <= 1e-6


def test_route_picks_the_lowest_id_among_equal_logits_and_is_sharp():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0]])
    weights, ids = triton_moe_route.moe_route_triton(logits, 2, True)
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights, torch.tensor([[0.5, 0.5]]))
    # a planted defect: one logit moved slightly changes the pick (the comparison is not vacuous)
    moved = logits.clone()
    moved[0, 4] += 1e-3
    assert triton_moe_route.moe_route_triton(moved, 2, True)[1].tolist() == [[4, 1]]


@pytest.mark.parametrize("fill", [float("nan"), float("-inf"), float("inf")])
def test_route_ids_stay_in_range_for_any_logits(fill):
    """A diverged model's logits (NaN, ±inf) still give K distinct expert ids < E (the expert kernels read weights
    at them: an id of E would read past the last expert)."""
    logits = torch.randn(3, 64)
    logits[0] = fill
    logits[1, ::2] = fill
    _, ids = triton_moe_route.moe_route_triton(logits, 8, True)
    assert ((ids >= 0) & (ids < 64)).all()
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert torch.equal(ids[2], moe_route_ref(logits[2:], 8, True)[1][0]), "a finite row is still the reference's"


def test_route_refuses_top_k_beyond_the_experts():
    with pytest.raises(ValueError, match="top_k 5 must be in 1..4"):
        triton_moe_route.moe_route_triton(torch.randn(2, 4), 5, True)


def test_route_entry_point_dispatches_to_reference_on_cpu():
    logits = torch.randn(3, 8)
    got, want = moe_route(logits, 2, False), moe_route_ref(logits, 2, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_gpu_route_matches_reference():
    logits = torch.randn(64, 512, device="cuda") * 2   # fp32: no equal logits (whose order torch leaves open)
    for renormalise in (True, False):
        want_w, want_ids = moe_route_ref(logits, 10, renormalise)
        got_w, got_ids = moe_route(logits, 10, renormalise)
        assert torch.equal(got_ids, want_ids)
        assert (got_w - want_w).abs().max().item() <= 1e-5
