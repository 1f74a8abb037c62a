"""Triton RMSNorms: zero-centred with the residual add fused, and the gated GDN output norm.

Same signatures and roundings as `reference.py` (the fused add is rounded to the input dtype before it is
normalised, and the gated norm rounds rms(o) and w·rms(o) to o's dtype exactly where the torch code does).
Each program normalises ROWS rows of the flattened [rows, H] input; sums of squares in fp32.
"""
import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # rows per program × padded row width: enough work per program, few registers
MIN_PROGRAMS = 128    # about one program per SM before rows are packed together (H100: 132 SMs)


# num_rows varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, sum_ptr, num_rows, eps, stride_x, stride_r,
                     H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]                                      # [ROWS, BLOCK_H] outputs
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)                           # [ROWS]
    w = tl.load(weight_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = xf * rstd[:, None] * (1.0 + w[None, :])
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# num_rows varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(o_ptr, z_ptr, weight_ptr, y_ptr, num_rows, eps, stride_o, stride_zt, stride_zh,
                           V: tl.constexpr, BLOCK_V: tl.constexpr, ROWS: tl.constexpr, Z_HEADS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_V)
    mask = (rows < num_rows)[:, None] & (cols < V)[None, :]
    offs = rows[:, None] * V + cols[None, :]
    o = tl.load(o_ptr + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0)
    of = o.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(of * of, axis=1) / V + eps)
    w = tl.load(weight_ptr + cols, mask=cols < V, other=0.0)
    normed = (of * rstd[:, None]).to(o.dtype).to(tl.float32)                     # rms(o) in o's dtype
    normed = (normed * w[None, :].to(tl.float32)).to(o.dtype).to(tl.float32)    # w · rms(o) in o's dtype
    z_row = (rows // Z_HEADS) * stride_zt + (rows % Z_HEADS) * stride_zh    # z: [T, Z_HEADS, V] with any strides
    z = tl.load(z_ptr + z_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = normed * (z * tl.sigmoid(z))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def row_tiling(num_rows: int, width: int) -> tuple[int, int, tuple[int]]:
    """(padded width, rows per program, grid) for a kernel that takes whole rows of `width` elements.

    Rows are packed up to TILE_ELEMENTS per program only once there are MIN_PROGRAMS programs: a decode step's
    few short rows (16 q heads of 256 at batch 1) then spread over 16 SMs instead of queueing in one program."""
    block = triton.next_power_of_2(width)
    spread = triton.next_power_of_2(triton.cdiv(max(1, num_rows), MIN_PROGRAMS))
    rows = max(1, min(TILE_ELEMENTS // block, spread))
    return block, rows, (triton.cdiv(num_rows, rows),)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., W] as [rows, W] with unit column stride: a view when the strides allow (e.g. q sliced out of
    [T, NH, 2D]), else a copy."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H], weight [H] → (y, x + residual) — or (y, x) without a residual."""
    width = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    num_rows = x.numel() // max(1, width)
    if num_rows == 0:
        return y, total
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    block, rows, grid = row_tiling(num_rows, width)
    _rms_norm_kernel[grid](x2, r2, weight.contiguous(), y, total, num_rows, eps, x2.stride(0), r2.stride(0),
                           H=width, BLOCK_H=block, ROWS=rows, HAS_RESIDUAL=residual is not None,
                           num_warps=8 if block >= 4096 else 4)
    return y, total


def gated_rms_norm_triton(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z [..., V], weight [V] → w · rms(o) · silu(z)."""
    width = o.shape[-1]
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    num_rows = o.numel() // max(1, width)
    if num_rows == 0:
        return y
    o2 = _rows(o)
    # z may be a column slice of a fused projection ([T, HV, V] with row stride > HV * V): read in place
    z3 = z.reshape(-1, 1, width) if z.dim() < 3 else z.reshape(-1, *z.shape[-2:])
    if z3.stride(-1) != 1:
        z3 = z3.contiguous()
    block, rows, grid = row_tiling(num_rows, width)
    _gated_rms_norm_kernel[grid](o2, z3, weight.contiguous(), y, num_rows, eps, o2.stride(0), z3.stride(0),
                                 z3.stride(1), V=width, BLOCK_V=block, ROWS=rows, Z_HEADS=z3.shape[1], num_warps=4)
    return y
