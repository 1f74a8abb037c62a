"""FP8 routed experts (float8_e4m3fn with block scales): each MoE kernel (per-pair GEMVs, scan kernels, grouped
GEMMs) against the torch reference, which dequantizes a reached expert. CPU: under TRITON_INTERPRET=1, small
shapes with partial edge blocks in both directions. GPU (`-m gpu`): the 4B-preset MoE shape in bf16."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.moe import ExpertScales, SharedExpert, moe_experts, moe_experts_ref, triton_experts  # noqa: E402
from specdec.models.fp8 import dequantize_blocks, quantize_blocks  # noqa: E402

pytest.importorskip("kernels.moe.triton_moe_decode")
KERNELS = {name: triton_experts(name) for name in ("grouped", "decode", "scan")}
BLOCK = (16, 16)


def fp8_experts(num_tokens, hidden, inter, num_experts, top_k, block=BLOCK, dtype=torch.float32, device="cpu",
                seed=0):
    """Random experts quantized in `block` blocks (rows of very different magnitude, so each scale matters), a
    softmax top-k routing, and the experts dequantized (what the reference multiplies)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * torch.logspace(-1, 0.5, 2 * inter)[:, None]
    down = torch.randn(num_experts, hidden, inter, generator=gen) * torch.logspace(-1, 0.5, hidden)[:, None]
    (q_gu, s_gu), (q_d, s_d) = quantize_blocks(gate_up, block), quantize_blocks(down, block)
    weights, ids = torch.randn(num_tokens, num_experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    scales = ExpertScales(s_gu.to(device), s_d.to(device), block)
    plain = tuple(dequantize_blocks(q, s, block, dtype).to(device) for q, s in ((q_gu, s_gu), (q_d, s_d)))
    return (x.to(device, dtype), q_gu.to(device), q_d.to(device), weights.to(device), ids.to(device), scales, plain)


CASES = {  # tokens, hidden, intermediate, experts, top_k
    "decode-1tok": (1, 40, 24, 5, 2),
    "verify-7tok": (7, 40, 24, 5, 2),
    "odd-33tok-top3": (33, 48, 40, 8, 3),
    "prefill-200tok": (200, 32, 24, 4, 2),
}


def test_the_reference_multiplies_the_dequantized_experts():
    x, gate_up, down, weights, ids, scales, (plain_gu, plain_d) = fp8_experts(6, 40, 24, 5, 2, seed=1)
    got = moe_experts_ref(x, gate_up, down, weights, ids, scales=scales)
    assert torch.equal(got, moe_experts_ref(x, plain_gu, plain_d, weights, ids))
    # planted defect: one scale block of expert ids[0, 0] doubled changes the result
    bad = ExpertScales(scales.gate_up.clone(), scales.down, scales.block)
    bad.gate_up[ids[0, 0], 0, 0] *= 2
    assert (moe_experts_ref(x, gate_up, down, weights, ids, scales=bad) - got).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fp8_experts_match_reference(case, kernel):
    x, gate_up, down, weights, ids, scales, _ = fp8_experts(*CASES[case], seed=len(case))
    want = moe_experts_ref(x, gate_up, down, weights, ids, scales=scales)
    got = KERNELS[kernel](x, gate_up, down, weights, ids, None, scales)
    assert not got.isnan().any()
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_plain_shared_expert_beside_fp8_experts_is_added_apart(kernel):
    """With FP8 experts the shared expert's weights (plain) are not fused as one more row (the rows would be
    scaled): it is computed apart and added, as the reference does."""
    x, gate_up, down, weights, ids, scales, _ = fp8_experts(3, 40, 24, 5, 2, seed=4)
    gen = torch.Generator().manual_seed(4)
    shared = SharedExpert(torch.randn(3, 1, generator=gen), gate_up=torch.randn(48, 40, generator=gen) * 0.1,
                          down=torch.randn(40, 24, generator=gen) * 0.1)
    want = moe_experts_ref(x, gate_up, down, weights, ids, shared, scales)
    got = KERNELS[kernel](x, gate_up, down, weights, ids, shared, scales)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_scales_need_fp8_experts_and_tiles_inside_their_blocks():
    x, gate_up, down, weights, ids, scales, (plain_gu, plain_d) = fp8_experts(2, 40, 24, 5, 2, seed=2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        KERNELS["decode"](x, plain_gu, plain_d, weights, ids, None, scales)
    _, q_gu, q_d, _, _, odd, _ = fp8_experts(2, 40, 24, 5, 2, block=(16, 24), seed=2)   # 24 columns: no 16-tile fits
    with pytest.raises(ValueError, match="straddle"):
        KERNELS["scan"](x, q_gu, q_d, weights, ids, None, odd)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 300])
def test_gpu_fp8_experts_match_reference_at_the_4b_moe_shape(num_tokens):
    """bf16, hidden 2560, 64 experts of width 512, top 8, 128 x 128 blocks: whatever kernel the dispatcher picks
    (per-pair, scan, grouped) agrees with the reference within bf16 rounding."""
    x, gate_up, down, weights, ids, scales, _ = fp8_experts(num_tokens, 2560, 512, 64, 8, block=(128, 128),
                                                            dtype=torch.bfloat16, device="cuda", seed=num_tokens)
    want = moe_experts_ref(x.float(), gate_up, down, weights, ids, scales=scales)
    got = moe_experts(x, gate_up, down, weights, ids, scales=scales).float()
    assert (got - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item())
