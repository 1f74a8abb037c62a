"""Triton zero-centred RMSNorm + partial neox rotary of each q or k head, in one pass (same signature and
roundings as `reference.norm_rope_ref`).

Each program takes ROWS heads of the flattened [T · heads] rows. A head is read twice: in place, and at its
rotation partner (c + R/2 for c < R/2, c - R/2 for R/2 <= c < R), so the rotation needs no shuffle across
lanes; both reads are normalised with the same rstd and rounded to x's dtype, as the reference's norm output.
"""
import torch
import triton
import triton.language as tl

from kernels.rms_norm.triton_rms_norm import row_tiling


# num_rows varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_rows"])
def _norm_rope_kernel(x_ptr, weight_ptr, positions_ptr, inv_freq_ptr, y_ptr, num_rows, eps,
                      stride_xt, stride_xh, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      HALF: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)                    # [ROWS] flat heads
    cols = tl.arange(0, BLOCK_D)
    live = rows < num_rows
    mask = live[:, None] & (cols < D)[None, :]
    token = rows // HEADS
    base = token * stride_xt + (rows % HEADS) * stride_xh                               # [ROWS]
    x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)                                 # [ROWS]
    w = tl.load(weight_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = (xf * rstd[:, None] * (1.0 + w[None, :])).to(x.dtype).to(tl.float32)            # the norm, rounded
    rotates = cols < 2 * HALF                                                            # [BLOCK_D]
    first_half = cols < HALF
    partner = tl.where(first_half, cols + HALF, cols - HALF)
    pmask = live[:, None] & rotates[None, :]
    px = tl.load(x_ptr + base[:, None] + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    pw = tl.load(weight_ptr + partner, mask=rotates, other=0.0).to(tl.float32)
    py = (px * rstd[:, None] * (1.0 + pw[None, :])).to(x.dtype).to(tl.float32)
    py = tl.where(first_half[None, :], -py, py)                                          # rotate_half
    position = tl.load(positions_ptr + token, mask=live, other=0).to(tl.float32)       # [ROWS]
    inv = tl.load(inv_freq_ptr + tl.where(first_half, cols, cols - HALF), mask=rotates, other=0.0)
    angle = position[:, None] * inv[None, :].to(tl.float32)                            # [ROWS, BLOCK_D]
    cos = tl.cos(angle).to(x.dtype).to(tl.float32)
    sin = tl.sin(angle).to(x.dtype).to(tl.float32)
    roped = (y * cos).to(x.dtype).to(tl.float32) + (py * sin).to(x.dtype).to(tl.float32)
    out = tl.where(rotates[None, :], roped, y)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any token / head strides, contiguous D) → [T, heads, D] contiguous."""
    num_tokens, heads, width = x.shape
    half = inv_freq.numel()
    if 2 * half > width:
        raise ValueError(f"norm_rope: rotary dim {2 * half} exceeds the head dim {width}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((num_tokens, heads, width), dtype=x.dtype, device=x.device)
    num_rows = num_tokens * heads
    if num_rows == 0:
        return y
    block, rows, grid = row_tiling(num_rows, width)   # heads per program, as the RMSNorm tiles its rows
    _norm_rope_kernel[grid](
        x, weight.contiguous(), positions, inv_freq.contiguous(), y, num_rows, eps, x.stride(0), x.stride(1),
        HEADS=heads, D=width, BLOCK_D=block, HALF=half, ROWS=rows, num_warps=4)
    return y
