"""Triton linears over a block-scaled FP8 weight (same signature and roundings as `reference.fp8_linear_ref`).

Few rows (`ACTIVATION_ROWS` or fewer: decode, a short verify) run weight-only FP8: activations stay in their dtype
(W8A16), so a step reads one byte per weight instead of two. Each program owns BLOCK_N outputs × BLOCK_M rows and walks its share of K in steps of B1 columns (one scale block
wide), so a step's partial product takes one scale per output (each output loads its own: tiles need not align
with B0):

    accᵀ[n, m] += (Σ_{k in step j} weight[n, k] · x[m, k]) · scale_inv[n // B0, j]

The weight tile, converted to x's dtype in registers (exact: e4m3 values fit bf16 and fp16), is the dot's left
operand and x's tile the right one ("swap AB"): the tensor cores take a register operand only on the left, and the
weight's outputs fill the MMA's wide side while a decode step's few rows sit on its narrow side (BLOCK_M >= 16, the
rows past M masked). With few outputs (a 2560-wide projection) the K range is split over SPLIT_K programs that write
fp32 partial sums, added in a fixed order by a second kernel: no atomics, so a row's result never depends on its
batch mates. Rows past N and columns past K load as 0, so partial edge blocks need no padding.

More rows run W8A8 on the FP8 tensor cores: `_quantize_groups_kernel` quantizes x per row and B1-column group, then
`_w8a8_kernel` tiles [BLOCK_M, BLOCK_N] and walks K a group at a time:

    acc[m, n] += (xq[m, group j] · weight[n, group j]ᵀ) · sx[m, j] · scale_inv[n // B0, j]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .reference import ACTIVATION_ROWS, E4M3_MAX

E4M3: tl.constexpr = tl.constexpr(E4M3_MAX)


@dataclass(frozen=True)
class Fp8Tiles:
    block_m: int
    block_n: int
    split_k: int          # programs sharing one output tile's K range (their partial sums added in order)
    group_m: int          # W8A8: row tiles launched together over the same output tiles (L2 reuse)
    num_warps: int
    num_stages: int


MAX_SPLIT_K = 8
MIN_STEPS_PER_SPLIT = 4       # scale blocks (K steps) each split keeps at least
W8A8_PROGRAMS = 256           # W8A8 splits K while the launch has fewer programs than this (≈ 2 per H100 SM)


def choose_tiles(num_rows: int, num_outputs: int, num_cols: int, block_cols: int = 128,
                 weight_only: bool | None = None) -> Fp8Tiles:
    """Tiles by rows (M), outputs (N) and columns (K); from bench/kernels.py --fp8-linear --sweep on an H100 (the
    4B shape's projections). A GEMV splits K as far as 8 ways while each split keeps 4 or more scale blocks; W8A8
    splits K only while its output tiles leave SMs idle (the 2560-wide projections at up to a few hundred rows)."""
    steps = triton.cdiv(num_cols, block_cols)
    split = 1
    if num_rows <= ACTIVATION_ROWS if weight_only is None else weight_only:
        while split < MAX_SPLIT_K and steps >= 2 * split * MIN_STEPS_PER_SPLIT:
            split *= 2
        return Fp8Tiles(16, 64, split, 1, 4, 3)
    if num_rows > 256:
        return Fp8Tiles(128, 128, 1, 8, 8, 3)
    programs = triton.cdiv(num_rows, 64) * triton.cdiv(num_outputs, 64)
    while split < MAX_SPLIT_K and steps >= 2 * split * MIN_STEPS_PER_SPLIT and programs * split * 2 <= W8A8_PROGRAMS:
        split *= 2
    return Fp8Tiles(64, 64, split, 8, 4, 3)


@triton.jit(do_not_specialize=["num_rows"])
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, num_rows, num_cols, num_outputs, steps_per_split,
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
        acc += tl.dot(w.to(xt.dtype), xt) * scale[:, None]
    dest = out_ptr + split * stride_split + rows[None, :] * stride_out + outs[:, None]
    tl.store(dest, acc.to(out_ptr.dtype.element_ty), mask=out_ok[:, None] & row_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):                      # fixed order: deterministic
        total += tl.load(part_ptr + s * size + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: the conversion
    that follows is then exact (Triton's CPU interpreter rounds some values just under a power of two down a
    binade; the GPU's conversion agrees with this either way)."""
    exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # subnormals: 2^-6's spacing
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)                   # 2^(exponent - 3): 3 bits
    return ((v / ulp + 12582912.0) - 12582912.0) * ulp                                # + 1.5·2^23: rint in fp32


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_groups_kernel(x_ptr, xq_ptr, sx_ptr, num_rows, num_cols, stride_x, stride_sx,
                            B1: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)                               # [GROUPS]
    k = g[:, None] * B1 + tl.arange(0, B1)[None, :]                                     # [GROUPS, B1]
    ok = k < num_cols
    x = tl.load(x_ptr + row * stride_x + k, mask=ok, other=0.0).to(tl.float32)
    sx = tl.maximum(tl.max(tl.abs(x), axis=1) / E4M3, 1e-12)                           # [GROUPS]
    xq = _round_to_e4m3(tl.clamp(x / sx[:, None], -E4M3, E4M3))
    tl.store(xq_ptr + row * num_cols + k, xq.to(xq_ptr.dtype.element_ty), mask=ok)
    tl.store(sx_ptr + row * stride_sx + g, sx, mask=g * B1 < num_cols)


@triton.jit(do_not_specialize=["num_rows"])
def _w8a8_kernel(xq_ptr, sx_ptr, w_ptr, s_ptr, out_ptr, num_rows, num_cols, num_outputs, steps_per_split,
                 stride_sx, stride_w, stride_s, stride_out, stride_split,
                 B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    # programs in groups of GROUP_M row tiles walk the same output tiles together, so the weight stays in L2
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(num_outputs, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, B1)
    row_ok = rows < num_rows
    out_ok = outs < num_outputs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(num_cols, B1))
    for j in range(first, last):
        k = j * B1 + cols
        k_ok = k < num_cols
        a = tl.load(xq_ptr + rows[:, None] * num_cols + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)                                                           # [BLOCK_M, B1] e4m3
        sa = tl.load(sx_ptr + rows * stride_sx + j, mask=row_ok, other=0.0)              # [BLOCK_M]
        b = tl.load(w_ptr + outs[None, :] * stride_w + k[:, None], mask=k_ok[:, None] & out_ok[None, :],
                    other=0.0)                                                           # [B1, BLOCK_N] e4m3
        sb = tl.load(s_ptr + (outs // B0) * stride_s + j, mask=out_ok, other=0.0)        # [BLOCK_N]
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    tl.store(out_ptr + split * stride_split + rows[:, None] * stride_out + outs[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


def quantize_groups_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (xq [M, K] float8_e4m3fn, sx [M, ceil(K / group)] float32), as `reference.quantize_groups_ref`."""
    num_rows, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, group)
    xq = torch.empty((num_rows, num_cols), dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty((num_rows, num_groups), dtype=torch.float32, device=x.device)
    if num_rows:
        groups = min(8, triton.next_power_of_2(num_groups))
        _quantize_groups_kernel[(num_rows, triton.cdiv(num_groups, groups))](
            x, xq, sx, num_rows, num_cols, x.stride(0), sx.stride(0), B1=group, GROUPS=groups, num_warps=4)
    return xq, sx


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      tiles: Fp8Tiles | None = None, weight_only: bool | None = None) -> torch.Tensor:
    """x [M, K] (rows may be strided), weight [N, K] float8_e4m3fn, scale_inv [ceil(N/B0), ceil(K/B1)] float32
    → [M, N] in x's dtype. weight_only (default: M <= ACTIVATION_ROWS, as the reference): W8A16, else W8A8."""
    num_rows, num_cols = x.shape
    num_outputs = weight.shape[0]
    if block[1] < 16 or block[1] & (block[1] - 1):
        raise ValueError(f"fp8_linear: scale blocks {block[1]} columns wide (a power of two >= 16 is needed)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_rows, num_outputs), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    weight_only = num_rows <= ACTIVATION_ROWS if weight_only is None else weight_only
    t = tiles or choose_tiles(num_rows, num_outputs, num_cols, block[1], weight_only)
    steps = triton.cdiv(num_cols, block[1])
    per_split = triton.cdiv(steps, t.split_k)
    split_k = triton.cdiv(steps, per_split)
    dest = out if split_k == 1 else torch.empty((split_k, num_rows, num_outputs), dtype=torch.float32,
                                                device=x.device)
    stride_split = num_rows * num_outputs if split_k > 1 else 0
    if not weight_only:
        xq, sx = quantize_groups_triton(x, block[1])
        grid = (triton.cdiv(num_rows, t.block_m) * triton.cdiv(num_outputs, t.block_n), split_k)
        _w8a8_kernel[grid](xq, sx, weight, scale_inv, dest, num_rows, num_cols, num_outputs, per_split,
                           sx.stride(0), weight.stride(0), scale_inv.stride(0), num_outputs, stride_split,
                           B0=block[0], B1=block[1], BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP_M=t.group_m,
                           num_warps=t.num_warps, num_stages=t.num_stages)
    else:
        grid = (triton.cdiv(num_outputs, t.block_n), triton.cdiv(num_rows, t.block_m), split_k)
        _w8a16_kernel[grid](x, weight, scale_inv, dest, num_rows, num_cols, num_outputs, per_split,
                            x.stride(0), weight.stride(0), scale_inv.stride(0), num_outputs, stride_split,
                            B0=block[0], B1=block[1], BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                            num_warps=t.num_warps, num_stages=t.num_stages)
    if split_k > 1:
        size = num_rows * num_outputs
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](dest, out, size, SPLIT_K=split_k, BLOCK=1024, num_warps=4)
    return out
