"""Zero-centred RMSNorm (+ fused residual add) and the gated GDN output norm: Triton kernels vs the torch reference.

CPU: the Triton path under TRITON_INTERPRET=1 on small, odd shapes; outputs come from a NaN-filled allocator so an
unwritten element shows. GPU (`-m gpu`): the same checks at the Qwen3.5-4B shapes through the public entry points.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.rms_norm import gated_rms_norm, gated_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from kernel_cases import seeded_randn as randn  # noqa: E402

triton_norm = pytest.importorskip("kernels.rms_norm.triton_rms_norm")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def assert_close(got, want, dtype):
    assert not got.isnan().any(), "an output element was not written"
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def query_slice(num_tokens, num_heads, head_dim, dtype, seed, device="cpu"):
    """q as GatedAttention makes it: the first half of [T, NH, 2D] (not contiguous)."""
    return randn(num_tokens, num_heads, 2 * head_dim, dtype=dtype, seed=seed, device=device).split(head_dim, -1)[0]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(7, 40), (1, 24), (5, 3, 24), (33, 130), (301, 24)], ids=str)  # 301: packed rows
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(nan_outputs, dtype, shape, with_residual):
    dtype = DTYPES[dtype]
    x, weight = randn(*shape, dtype=dtype, seed=1), randn(shape[-1], dtype=dtype, seed=2) * 0.3
    residual = randn(*shape, dtype=dtype, seed=3) if with_residual else None
    y, total = triton_norm.rms_norm_triton(x, weight, 1e-6, residual)
    want_y, want_total = rms_norm_ref(x, weight, 1e-6, residual)
    assert_close(y, want_y, dtype)
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 → bf16; the GPU test checks the exact rounding
        assert_close(total, want_total, dtype)
    else:
        assert torch.equal(total, want_total), "the fused add must round exactly like the unfused one"
    if not with_residual:
        assert total is x


def test_rms_norm_on_a_strided_query_slice(nan_outputs):
    q = query_slice(6, 4, 24, torch.float32, seed=4)
    weight = randn(24, dtype=torch.float32, seed=5)
    assert not q.is_contiguous()
    assert_close(triton_norm.rms_norm_triton(q, weight, 1e-6)[0], rms_norm_ref(q, weight, 1e-6)[0], torch.float32)


def test_rms_norm_is_zero_centred():
    """Weight zero means scale one: the reference and the kernel both give rms(x), not zero."""
    x = randn(3, 40, dtype=torch.float32, seed=6)
    y, _ = triton_norm.rms_norm_triton(x, torch.zeros(40), 1e-6)
    assert torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(5, 3, 24), (1, 1, 40), (9, 4, 16), (101, 3, 24)], ids=str)
def test_gated_rms_norm_matches_reference(nan_outputs, dtype, shape):
    dtype = DTYPES[dtype]
    o, z = randn(*shape, dtype=dtype, seed=7), randn(*shape, dtype=dtype, seed=8)
    weight = 1.0 + 0.2 * randn(shape[-1], dtype=dtype, seed=9)
    assert_close(triton_norm.gated_rms_norm_triton(o, z, weight, 1e-6), gated_rms_norm_ref(o, z, weight, 1e-6),
                 dtype)


def test_gated_rms_norm_reads_z_from_a_fused_projection(nan_outputs):
    """z as GatedDeltaNet slices it from the fused [qkv | z | b | a] projection: [T, HV, V] views whose rows are
    further apart than HV * V."""
    fused = randn(5, 7 + 3 * 16 + 2, dtype=torch.float32, seed=13)
    z = fused[:, 7:7 + 48].view(5, 3, 16)
    o, weight = randn(5, 3, 16, dtype=torch.float32, seed=14), 1.0 + 0.2 * randn(16, dtype=torch.float32, seed=15)
    assert z.stride(0) != 48
    assert_close(triton_norm.gated_rms_norm_triton(o, z, weight, 1e-6), gated_rms_norm_ref(o, z, weight, 1e-6),
                 torch.float32)


def test_rows_spread_over_programs_before_they_are_packed():
    """A decode step's few heads get a program each; many rows share programs, with a partial last tile (the
    packed cases above: 301 rows, 4 per program)."""
    assert triton_norm.row_tiling(16, 256) == (256, 1, (16,))
    assert triton_norm.row_tiling(301, 24) == (32, 4, (76,))
    assert triton_norm.row_tiling(8192, 128) == (128, 32, (256,))   # capped at TILE_ELEMENTS per program


def test_empty_batch():
    y, total = triton_norm.rms_norm_triton(torch.zeros(0, 40), torch.zeros(40), 1e-6, torch.zeros(0, 40))
    assert y.shape == total.shape == (0, 40)
    assert triton_norm.gated_rms_norm_triton(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), torch.ones(8),
                                             1e-6).shape == (0, 2, 8)


def test_public_entry_points_dispatch_to_reference_on_cpu():
    x, r = (randn(4, 24, dtype=torch.float32, seed=s) for s in (10, 11))
    w = randn(24, dtype=torch.float32, seed=12)
    for got, want in zip(rms_norm(x, w, 1e-6, r), rms_norm_ref(x, w, 1e-6, r)):
        assert torch.equal(got, want)
    o = x.view(4, 2, 12)
    assert torch.equal(gated_rms_norm(o, o, w[:12], 1e-6), gated_rms_norm_ref(o, o, w[:12], 1e-6))


# ---- GPU, Qwen3.5-4B shapes: hidden 2560, q/k heads × 256, GDN 32 v-heads × 128, bf16 --------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 2048])
def test_gpu_4b_shapes(num_tokens, cuda):
    bf16, dev = torch.bfloat16, cuda
    x, r = randn(num_tokens, 2560, dtype=bf16, seed=1, device=dev), randn(num_tokens, 2560, dtype=bf16, seed=2,
                                                                            device=dev)
    w = 0.3 * randn(2560, dtype=bf16, seed=3, device=dev)
    y, total = rms_norm(x, w, 1e-6, r)
    want_y, want_total = rms_norm_ref(x, w, 1e-6, r)
    assert_close(y, want_y, bf16)
    assert torch.equal(total, want_total)
    q = query_slice(num_tokens, 16, 256, bf16, seed=4, device=dev)
    wq = 0.3 * randn(256, dtype=bf16, seed=5, device=dev)
    assert_close(rms_norm(q, wq, 1e-6)[0], rms_norm_ref(q, wq, 1e-6)[0], bf16)
    o, z = (randn(num_tokens, 32, 128, dtype=bf16, seed=s, device=dev) for s in (6, 7))
    wg = 1.0 + 0.2 * randn(128, dtype=bf16, seed=8, device=dev)
    assert_close(gated_rms_norm(o, z, wg, 1e-6), gated_rms_norm_ref(o, z, wg, 1e-6), bf16)
