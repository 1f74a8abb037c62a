"""FP8 block-scaled linear: the Triton kernel against the torch reference, every tile choice.

CPU: the kernel under TRITON_INTERPRET=1 on small shapes with partial edge blocks. GPU (`-m gpu`): the 4B
shape's projections in bf16 at decode, verify and prefill row counts, and in a CUDA graph.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.fp8_linear.reference import ACTIVATION_ROWS, dequantize_weight, fp8_linear_ref, quantize_groups_ref  # noqa: E402,E501
from specdec.models.fp8 import quantize_blocks  # noqa: E402

triton_fp8 = pytest.importorskip("kernels.fp8_linear.triton_fp8_linear")


def make_case(num_rows, num_outputs, num_cols, block, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_cols, generator=gen)
    # rows of very different magnitude, so that each scale block matters
    w = torch.randn(num_outputs, num_cols, generator=gen) * torch.logspace(-2, 1, num_outputs)[:, None]
    q, scale_inv = quantize_blocks(w, block)
    return x.to(device=device, dtype=dtype), q.to(device), scale_inv.to(device)


def test_reference_is_the_dequantized_matmul():
    x, q, s = make_case(3, 70, 50, (32, 16))
    want = torch.stack([torch.tensor([sum(float(x[m, k]) * float(q[n, k].float()) * float(s[n // 32, k // 16])
                                          for k in range(50)) for n in range(70)]) for m in range(3)])
    assert torch.allclose(fp8_linear_ref(x, q, s, (32, 16)), want.float(), atol=1e-4, rtol=1e-5)
    assert dequantize_weight(q, s, (32, 16)).shape == (70, 50)


CASES = {  # rows, outputs, columns, block — partial blocks in both directions
    "decode-1row": (1, 70, 150, (32, 64)),
    "decode-2rows": (2, 33, 150, (32, 64)),
    "verify-5rows-dot": (5, 70, 150, (32, 64)),
    "verify-40rows": (40, 130, 100, (128, 32)),
    "prefill-300rows": (300, 140, 80, (64, 16)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_triton_matches_reference(case):
    rows, outputs, cols, block = CASES[case]
    x, q, s = make_case(rows, outputs, cols, block, seed=len(case))
    want = fp8_linear_ref(x, q, s, block)
    got = triton_fp8.fp8_linear_triton(x, q, s, block)
    assert got.shape == (rows, outputs) and not got.isnan().any()
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


W8A16_TILES = [triton_fp8.Fp8Tiles(16, 16, 1, 1, 4, 2), triton_fp8.Fp8Tiles(16, 32, 3, 1, 4, 2),
               triton_fp8.Fp8Tiles(16, 16, 2, 1, 4, 2), triton_fp8.Fp8Tiles(32, 64, 1, 1, 4, 2)]
W8A8_TILES = [triton_fp8.Fp8Tiles(16, 16, 1, 1, 4, 2), triton_fp8.Fp8Tiles(32, 16, 1, 2, 4, 2),
              triton_fp8.Fp8Tiles(16, 64, 1, 8, 4, 2), triton_fp8.Fp8Tiles(16, 16, 3, 8, 4, 2)]


@pytest.mark.parametrize("tiles", W8A16_TILES, ids=lambda t: f"m{t.block_m}n{t.block_n}k{t.split_k}")
def test_every_gemv_tiling_matches_reference(tiles):
    """Split K (3 splits over 3 column blocks, 2 over 3: the second shorter), masked edges."""
    x, q, s = make_case(7, 45, 96, (16, 32), seed=1)
    got = triton_fp8.fp8_linear_triton(x, q, s, (16, 32), tiles=tiles)
    assert torch.allclose(got, fp8_linear_ref(x, q, s, (16, 32)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiles", W8A8_TILES, ids=lambda t: f"m{t.block_m}n{t.block_n}k{t.split_k}g{t.group_m}")
@pytest.mark.parametrize("rows", [70, 300])
def test_every_w8a8_tiling_matches_reference(tiles, rows):
    """Row tiles grouped for L2 reuse (groups of 1, 2 and more than there are), split K, masked edges."""
    x, q, s = make_case(rows, 45, 96, (16, 32), seed=3)
    got = triton_fp8.fp8_linear_triton(x, q, s, (16, 32), tiles=tiles)
    assert torch.allclose(got, fp8_linear_ref(x, q, s, (16, 32)), atol=1e-4, rtol=1e-4)


def test_a_rows_result_does_not_depend_on_its_batch():
    """W8A8: the same row alone, among 70 and among 300 rows (other tiles) gives the same output."""
    x, q, s = make_case(300, 45, 96, (16, 32), seed=6)
    full = triton_fp8.fp8_linear_triton(x, q, s, (16, 32), weight_only=False)
    some = triton_fp8.fp8_linear_triton(x[:70], q, s, (16, 32), weight_only=False)
    one = triton_fp8.fp8_linear_triton(x[:1], q, s, (16, 32), weight_only=False)
    assert torch.allclose(some, full[:70], atol=1e-5, rtol=1e-5) and torch.allclose(one, full[:1], atol=1e-5)


def test_activation_groups_quantize_as_the_reference():
    x = torch.randn(5, 100) * torch.logspace(-3, 2, 100)
    x[2] = 0.0                                     # an all-zero row: scale clamped, values 0
    xq, sx = triton_fp8.quantize_groups_triton(x, 32)
    want_q, want_s = quantize_groups_ref(x, 32)
    assert sx.shape == (5, 4) and torch.equal(sx, want_s)
    assert torch.equal(xq.float(), want_q.float())


def test_more_rows_quantize_the_activations():
    """Past ACTIVATION_ROWS rows the reference rounds x through FP8 groups; at or under it x is used as it is."""
    x, q, s = make_case(ACTIVATION_ROWS + 1, 40, 64, (16, 32), seed=5)
    exact = (x.float() @ dequantize_weight(q, s, (16, 32)).t())
    assert torch.allclose(fp8_linear_ref(x[:ACTIVATION_ROWS], q, s, (16, 32)), exact[:ACTIVATION_ROWS])
    assert not torch.allclose(fp8_linear_ref(x, q, s, (16, 32)), exact, atol=1e-5, rtol=1e-5)


def test_strided_rows_and_refused_blocks():
    x, q, s = make_case(6, 40, 64, (16, 32), seed=2)
    wide = torch.cat([x, torch.randn(6, 8)], dim=1)[:, :64]          # rows strided by 72
    assert torch.allclose(triton_fp8.fp8_linear_triton(wide, q, s, (16, 32)), fp8_linear_ref(x, q, s, (16, 32)),
                          atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        triton_fp8.fp8_linear_triton(x, q, quantize_blocks(q.float(), (16, 24))[1], (16, 24))


def test_tile_choice_covers_decode_verify_and_prefill():
    for rows in (1, 2, 3, 16, 17, 64, 65, 256, 300, 4096):
        for outputs, cols in ((64, 256), (2560, 9216), (12288, 2560)):
            t = triton_fp8.choose_tiles(rows, outputs, cols)
            assert t.block_m >= 16 and math.log2(t.block_m).is_integer() and math.log2(t.block_n).is_integer()
            assert 1 <= t.split_k <= max(1, cols // 128 // 4), (rows, outputs, t)
    # a decode GEMV splits K while each split keeps 4+ scale blocks; W8A8 only while few output tiles fill the GPU
    assert triton_fp8.choose_tiles(1, 2560, 9216).split_k == 8
    assert triton_fp8.choose_tiles(1, 18432, 2560).split_k == 4
    assert triton_fp8.choose_tiles(64, 2560, 9216).split_k == 4
    assert triton_fp8.choose_tiles(64, 18432, 2560).split_k == 1
    assert triton_fp8.choose_tiles(1024, 2560, 9216).split_k == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 16, 64, 256, 1024])
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
