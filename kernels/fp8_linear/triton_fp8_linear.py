"""Triton linear over a block-scaled FP8 weight (same signature as `reference.fp8_linear_ref`): weight-only FP8,
activations stay in their dtype (W8A16), so a decode or verify step reads one byte per weight instead of two.

Up to GEMV_ROWS rows each program owns BLOCK_N outputs × BLOCK_M rows and walks its share of K in steps of B1
columns (one scale block wide), so a step's partial product takes one scale per output (each output loads its own:
tiles need not align with B0):

    accᵀ[n, m] += (Σ_{k in step j} weight[n, k] · x[m, k]) · scale_inv[n // B0, j]

The weight tile, converted to x's dtype in registers (exact: e4m3 values fit bf16 and fp16), is the dot's left
operand and x's tile the right one ("swap AB"): the tensor cores take a register operand only on the left, and the
weight's outputs fill the MMA's wide side while a step's few rows sit on its narrow side (BLOCK_M >= 16, the rows
past M masked). K is split over SPLIT_K programs that write fp32 partial sums, added in a fixed order by a second
kernel: no atomics, so a row's result never depends on its batch mates. Rows past N and columns past K load as 0,
so partial edge blocks need no padding.

More rows (a prompt chunk) dequantize the weight into x's dtype (`_dequantize_kernel`) and run the dense GEMM, which
the tensor-core loop above does not match there (bench/kernels.py --fp8-linear).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GEMV_ROWS = 128               # more rows: dequantize, then the dense GEMM
MAX_SPLIT_K = 8
MIN_STEPS_PER_SPLIT = 4       # scale blocks (K steps) each split keeps at least


@dataclass(frozen=True)
class Fp8Tiles:
    block_m: int
    block_n: int
    split_k: int          # programs sharing one output tile's K range (their partial sums added in order)
    num_warps: int
    num_stages: int


def choose_tiles(num_rows: int, num_cols: int, block_cols: int = 128) -> Fp8Tiles:
    """Tiles by rows (M) and columns (K): K is split as far as 8 ways while each split keeps 4 or more scale blocks,
    the best of bench/kernels.py --fp8-linear --sweep on an H100 at 1-16 rows (the 4B shape's projections); the
    same rule with 32- and 64-row tiles above is not measured yet."""
    steps = triton.cdiv(num_cols, block_cols)
    split = 1
    while split < MAX_SPLIT_K and steps >= 2 * split * MIN_STEPS_PER_SPLIT:
        split *= 2
    return Fp8Tiles(16 if num_rows <= 16 else 32 if num_rows <= 32 else 64, 64, split, 4, 3)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, num_rows, num_cols, num_outputs, steps_per_split,
                     stride_x, stride_w, stride_s, stride_out, stride_split,
                     B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    outs = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)             # [BLOCK_N]
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)             # [BLOCK_M]
    cols = tl.arange(0, B1)                                                  # [B1]
    out_ok = outs < num_outputs
    row_ok = rows < num_rows
    w_base = w_ptr + outs[:, None] * stride_w
    x_base = x_ptr + rows[None, :] * stride_x
    s_base = s_ptr + (outs // B0) * stride_s
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(num_cols, B1))
    for j in range(first, last):
        k = j * B1 + cols
        k_ok = k < num_cols
        w = tl.load(w_base + k[None, :], mask=out_ok[:, None] & k_ok[None, :], other=0.0)     # [BLOCK_N, B1] e4m3
        xt = tl.load(x_base + k[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)    # [B1, BLOCK_M]
        scale = tl.load(s_base + j, mask=out_ok, other=0.0)                                    # [BLOCK_N]
        acc += tl.dot(w.to(xt.dtype), xt, input_precision="ieee") * scale[:, None]
    dest = out_ptr + split.to(tl.int64) * stride_split + rows[None, :] * stride_out + outs[:, None]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=out_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["size"])
def _sum_splits_kernel(part_ptr, out_ptr, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):                      # fixed order: deterministic
        total += tl.load(part_ptr + s * size.to(tl.int64) + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, num_outputs, num_cols, stride_w, stride_s, stride_out,
                       B0: tl.constexpr, B1: tl.constexpr):
    i = tl.program_id(0)                                     # one B0 x B1 scale block per program
    j = tl.program_id(1)
    outs = i.to(tl.int64) * B0 + tl.arange(0, B0)
    k = j * B1 + tl.arange(0, B1)
    ok = (outs < num_outputs)[:, None] & (k < num_cols)[None, :]
    w = tl.load(w_ptr + outs[:, None] * stride_w + k[None, :], mask=ok, other=0.0)
    scale = tl.load(s_ptr + i * stride_s + j)
    tl.store(out_ptr + outs[:, None] * stride_out + k[None, :],
             (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_triton(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn × scale_inv per block → [N, K] in `dtype` (rounded once from fp32)."""
    num_outputs, num_cols = weight.shape
    out = torch.empty((num_outputs, num_cols), dtype=dtype, device=weight.device)
    grid = (triton.cdiv(num_outputs, block[0]), triton.cdiv(num_cols, block[1]))
    _dequantize_kernel[grid](weight, scale_inv, out, num_outputs, num_cols, weight.stride(0), scale_inv.stride(0),
                             out.stride(0), B0=block[0], B1=block[1], num_warps=8)
    return out


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      tiles: Fp8Tiles | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided), weight [N, K] float8_e4m3fn, scale_inv [ceil(N/B0), ceil(K/B1)] float32
    → [M, N] in x's dtype. `tiles`: the GEMV's tiling (default: choose_tiles; given, any row count takes it)."""
    num_rows, num_cols = x.shape
    num_outputs = weight.shape[0]
    if block[1] < 16 or block[1] & (block[1] - 1):
        raise ValueError(f"fp8_linear: scale blocks {block[1]} columns wide (a power of two >= 16 is needed)")
    if tiles is None and num_rows > GEMV_ROWS:
        return torch.nn.functional.linear(x, dequantize_triton(weight, scale_inv, block, x.dtype))
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_rows, num_outputs), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiling = tiles or choose_tiles(num_rows, num_cols, block[1])
    steps = triton.cdiv(num_cols, block[1])
    per_split = triton.cdiv(steps, tiling.split_k)
    split_k = triton.cdiv(steps, per_split)
    dest = out if split_k == 1 else torch.empty((split_k, num_rows, num_outputs), dtype=torch.float32,
                                                device=x.device)                    # [split_k, M, N] partial sums
    grid = (triton.cdiv(num_outputs, tiling.block_n), triton.cdiv(num_rows, tiling.block_m), split_k)
    _fp8_gemv_kernel[grid](x, weight, scale_inv, dest, num_rows, num_cols, num_outputs, per_split,
                           x.stride(0), weight.stride(0), scale_inv.stride(0), num_outputs,
                           num_rows * num_outputs if split_k > 1 else 0, B0=block[0], B1=block[1],
                           BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, num_warps=tiling.num_warps,
                           num_stages=tiling.num_stages)
    if split_k > 1:
        size = num_rows * num_outputs
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](dest, out, size, SPLIT_K=split_k, BLOCK=1024, num_warps=4)
    return out
