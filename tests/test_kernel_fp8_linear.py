"""FP8 block-scaled linear (FP8 weights, activations in their dtype): the Triton kernels against the torch reference.

CPU: the kernels under TRITON_INTERPRET=1 on small shapes with partial edge blocks. GPU (`-m gpu`): the 4B
shape's projections in bf16 at decode, verify and prefill row counts, and in a CUDA graph.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.fp8_linear.reference import dequantize_weight, fp8_linear_ref  # noqa: E402
from specdec.models.fp8 import quantize_blocks  # noqa: E402

triton_fp8 = pytest.importorskip("kernels.fp8_linear.triton_fp8_linear")


def make_case(num_rows, num_outputs, num_cols, block, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_cols, generator=gen)
    # rows of very different magnitude, so that each scale block matters
    w = torch.randn(num_outputs, num_cols, generator=gen) * torch.logspace(-2, 1, num_outputs)[:, None]
    q, scale_inv = quantize_blocks(w, block)
    return x.to(device=device, dtype=dtype), q.to(device), scale_inv.to(device)


def test_reference_is_the_block_scaled_sum():
    """out[m, n] = Σ_k x[m, k] · weight[n, k] · scale_inv[n // B0, k // B1], element by element."""
    x, q, s = make_case(3, 70, 50, (32, 16))
    want = torch.tensor([[sum(float(x[m, k]) * float(q[n, k].float()) * float(s[n // 32, k // 16])
                              for k in range(50)) for n in range(70)] for m in range(3)])
    assert torch.allclose(fp8_linear_ref(x, q, s, (32, 16)), want.float(), atol=1e-4, rtol=1e-5)
    assert dequantize_weight(q, s, (32, 16)).shape == (70, 50)


CASES = {  # rows, outputs, columns, block — partial blocks in both directions
    "decode-1row": (1, 70, 150, (32, 64)),
    "decode-2rows": (2, 33, 150, (32, 64)),
    "verify-5rows": (5, 70, 150, (32, 64)),
    "verify-40rows": (40, 130, 100, (128, 32)),
    "prefill-300rows-dequantized": (300, 140, 80, (64, 16)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_matches_reference(case):
    rows, outputs, cols, block = CASES[case]
    x, q, s = make_case(rows, outputs, cols, block, seed=len(case))
    want = fp8_linear_ref(x, q, s, block)
    got = triton_fp8.fp8_linear_triton(x, q, s, block)
    assert got.shape == (rows, outputs) and not got.isnan().any()
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


TILES = [triton_fp8.Fp8Tiles(16, 16, 1, 4, 2), triton_fp8.Fp8Tiles(16, 32, 3, 4, 2),
         triton_fp8.Fp8Tiles(16, 16, 2, 4, 2), triton_fp8.Fp8Tiles(32, 64, 1, 4, 2)]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"m{t.block_m}n{t.block_n}k{t.split_k}")
@pytest.mark.parametrize("rows", [7, 40])
def test_every_tiling_matches_reference(tiles, rows):
    """Split K (3 splits over 3 column blocks, 2 over 3: the second shorter), several row tiles, masked edges."""
    x, q, s = make_case(rows, 45, 96, (16, 32), seed=1)
    got = triton_fp8.fp8_linear_triton(x, q, s, (16, 32), tiles=tiles)
    assert torch.allclose(got, fp8_linear_ref(x, q, s, (16, 32)), atol=1e-4, rtol=1e-4)


def test_dequantize_matches_reference():
    _, q, s = make_case(1, 45, 96, (16, 32), seed=4)
    assert torch.equal(triton_fp8.dequantize_triton(q, s, (16, 32), torch.float32), dequantize_weight(q, s, (16, 32)))


def test_a_rows_result_stays_within_rounding_whatever_the_steps_size():
    """The same rows alone, in a verify-sized step and in a prompt-sized one (dequantized): the same outputs up to
    summation order (a continuous function of x: no rounding of the activations that a tiny difference could flip)."""
    x, q, s = make_case(300, 45, 96, (16, 32), seed=6)
    full = triton_fp8.fp8_linear_triton(x, q, s, (16, 32))
    for rows in (1, 4, 70):
        assert torch.allclose(triton_fp8.fp8_linear_triton(x[:rows], q, s, (16, 32)), full[:rows], atol=1e-5)


def test_strided_rows_and_refused_blocks():
    x, q, s = make_case(6, 40, 64, (16, 32), seed=2)
    wide = torch.cat([x, torch.randn(6, 8)], dim=1)[:, :64]          # rows strided by 72
    assert torch.allclose(triton_fp8.fp8_linear_triton(wide, q, s, (16, 32)), fp8_linear_ref(x, q, s, (16, 32)),
                          atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        triton_fp8.fp8_linear_triton(x, q, quantize_blocks(q.float(), (16, 24))[1], (16, 24))


def test_tile_choice_covers_decode_and_verify():
    for rows in (1, 2, 3, 16, 17, 33, 64, 128):
        for cols in (256, 2560, 4096, 9216):
            t = triton_fp8.choose_tiles(rows, cols)
            assert t.block_m >= min(rows, 64) and math.log2(t.block_m).is_integer()   # up to 64 rows: one row tile
            assert 1 <= t.split_k <= max(1, cols // 128 // 4), (rows, cols, t)
    # K is split as far as 8 ways while each split keeps 4+ scale blocks
    assert [triton_fp8.choose_tiles(1, cols).split_k for cols in (256, 2560, 4096, 9216)] == [1, 4, 8, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 16, 64, 128, 256, 1024])
def test_gpu_4b_projections_match_reference(rows):
    for outputs, cols in ((12288, 2560), (2560, 9216), (2560, 4096), (18432, 2560)):
        x, q, s = make_case(rows, outputs, cols, (128, 128), dtype=torch.bfloat16, device="cuda", seed=rows)
        want = fp8_linear_ref(x, q, s, (128, 128)).float()
        got = triton_fp8.fp8_linear_triton(x, q, s, (128, 128)).float()
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item(), (rows, outputs, cols)


@pytest.mark.gpu
def test_gpu_fp8_linear_in_a_cuda_graph():
    x, q, s = make_case(4, 2560, 2560, (128, 128), dtype=torch.bfloat16, device="cuda")
    want = triton_fp8.fp8_linear_triton(x, q, s, (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_fp8.fp8_linear_triton(x, q, s, (128, 128))
    x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(got.float(), 2 * want.float(), rtol=2e-2, atol=1e-2)
