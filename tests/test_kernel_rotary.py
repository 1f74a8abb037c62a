"""q/k norm + partial rotary (kernels.rotary) and SwiGLU's silu · up (kernels.activation): Triton kernels vs their
torch references.

CPU: the Triton path under TRITON_INTERPRET=1 on small, odd shapes (non-power-of-two head dims, strided q slices,
outputs from a NaN-filled allocator). GPU (`-m gpu`): the same checks at the Qwen3.5-4B shapes through the public
entry points.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.activation import silu_mul, silu_mul_ref  # noqa: E402
from kernels.rms_norm import rms_norm_ref  # noqa: E402
from kernels.rotary import norm_rope, norm_rope_ref, rope_ref  # noqa: E402
from kernel_cases import seeded_randn as randn  # noqa: E402

triton_rope = pytest.importorskip("kernels.rotary.triton_norm_rope")
triton_act = pytest.importorskip("kernels.activation.triton_silu_mul")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def inv_freq(rotary_dim, theta=10000.0, device="cpu"):
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)


def assert_close(got, want, dtype):
    assert not got.isnan().any(), "an output element was not written"
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_rope_reference_rotates_pairs_by_position():
    """The reference itself: at position p the pair (c, c + R/2) turns by p · inv_freq[c]; dims past R pass.
    (Angles are fp32 in the reference, as in the model: hence the tolerance.)"""
    x = randn(3, 2, 10, dtype=torch.float64, seed=1)
    positions = torch.tensor([0, 5, 1000])
    inv = inv_freq(6).double()
    y = rope_ref(x, positions, inv)
    for t, p in enumerate(positions.tolist()):
        for c in range(3):
            angle = p * inv[c]
            a, b = x[t, :, c], x[t, :, c + 3]
            close = dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y[t, :, c], a * torch.cos(angle) - b * torch.sin(angle), **close)
            torch.testing.assert_close(y[t, :, c + 3], b * torch.cos(angle) + a * torch.sin(angle), **close)
    assert torch.equal(y[..., 6:], x[..., 6:])
    assert torch.equal(y[0], x[0])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("tokens, heads, head_dim, rotary_dim", [(5, 3, 24, 6), (1, 1, 40, 40), (7, 2, 20, 8),
                                                                  (4, 5, 16, 4), (67, 5, 16, 4)], ids=str)
def test_norm_rope_matches_reference(nan_outputs, dtype, tokens, heads, head_dim, rotary_dim):
    dtype = DTYPES[dtype]
    x = randn(tokens, heads, head_dim, dtype=dtype, seed=2)
    weight = 0.3 * randn(head_dim, dtype=dtype, seed=3)
    positions = torch.randint(0, 3000, (tokens,), generator=torch.Generator().manual_seed(4))
    inv = inv_freq(rotary_dim)
    assert_close(triton_rope.norm_rope_triton(x, weight, 1e-6, positions, inv),
                 norm_rope_ref(x, weight, 1e-6, positions, inv), dtype)


def test_norm_rope_on_a_strided_query_slice(nan_outputs):
    """q as GatedAttention slices it: the first half of [T, NH, 2D], itself columns of a fused projection."""
    fused = randn(6, 4 * 2 * 24 + 11, dtype=torch.float32, seed=5)
    q = fused[:, : 4 * 48].view(6, 4, 48)[..., :24]
    assert not q.is_contiguous()
    weight, positions, inv = randn(24, dtype=torch.float32, seed=6), torch.arange(6) * 7, inv_freq(12)
    got = triton_rope.norm_rope_triton(q, weight, 1e-6, positions, inv)
    assert_close(got, norm_rope_ref(q, weight, 1e-6, positions, inv), torch.float32)
    assert got.is_contiguous()


def test_norm_rope_is_norm_then_rope():
    """The fused reference equals the two steps it replaces (the model's former q_norm, then the rotary)."""
    x, w = randn(4, 2, 16, dtype=torch.float32, seed=7), randn(16, dtype=torch.float32, seed=8)
    positions, inv = torch.tensor([3, 9, 27, 81]), inv_freq(8)
    assert torch.equal(norm_rope_ref(x, w, 1e-6, positions, inv),
                       rope_ref(rms_norm_ref(x, w, 1e-6)[0], positions, inv))


def test_norm_rope_refuses_a_rotary_dim_past_the_head():
    with pytest.raises(ValueError, match="rotary dim 16 exceeds the head dim 8"):
        triton_rope.norm_rope_triton(torch.zeros(1, 1, 8), torch.zeros(8), 1e-6, torch.zeros(1), inv_freq(16))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("rows, width", [(1, 24), (5, 37), (3, 1030)], ids=str)
def test_silu_mul_matches_reference(nan_outputs, dtype, rows, width):
    dtype = DTYPES[dtype]
    gate_up = 3 * randn(rows, 2 * width, dtype=dtype, seed=9)
    assert_close(triton_act.silu_mul_triton(gate_up), silu_mul_ref(gate_up), dtype)


def test_silu_mul_on_strided_rows(nan_outputs):
    gate_up = randn(4, 2 * 20 + 6, dtype=torch.float32, seed=10)[:, : 2 * 20]
    assert_close(triton_act.silu_mul_triton(gate_up), silu_mul_ref(gate_up), torch.float32)


def test_empty_batches():
    assert triton_rope.norm_rope_triton(torch.zeros(0, 2, 8), torch.zeros(8), 1e-6, torch.zeros(0, dtype=torch.long),
                                        inv_freq(4)).shape == (0, 2, 8)
    assert triton_act.silu_mul_triton(torch.zeros(0, 8)).shape == (0, 4)


def test_public_entry_points_dispatch_to_reference_on_cpu():
    x, w = randn(2, 3, 16, dtype=torch.float32, seed=11), randn(16, dtype=torch.float32, seed=12)
    positions, inv = torch.tensor([1, 2]), inv_freq(8)
    assert torch.equal(norm_rope(x, w, 1e-6, positions, inv), norm_rope_ref(x, w, 1e-6, positions, inv))
    gu = randn(3, 10, dtype=torch.float32, seed=13)
    assert torch.equal(silu_mul(gu), silu_mul_ref(gu))


# ---- GPU, Qwen3.5-4B shapes: 16 q heads / 4 kv heads × 256 (rotary 64), intermediate 9216, bf16 --------------
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 2048])
def test_gpu_4b_shapes(num_tokens, cuda):
    bf16, dev = torch.bfloat16, cuda
    query_gate = randn(num_tokens, 16, 512, dtype=bf16, seed=1, device=dev)
    q = query_gate[..., :256]
    w = 0.3 * randn(256, dtype=bf16, seed=2, device=dev)
    positions = torch.randint(0, 32768, (num_tokens,), device=dev)
    inv = inv_freq(64, theta=10_000_000.0, device=dev)
    assert_close(norm_rope(q, w, 1e-6, positions, inv), norm_rope_ref(q, w, 1e-6, positions, inv), bf16)
    gate_up = randn(num_tokens, 2 * 9216, dtype=bf16, seed=3, device=dev)
    assert_close(silu_mul(gate_up), silu_mul_ref(gate_up), bf16)
