"""Triton silu(gate) · up over a fused [T, 2I] projection (same signature and roundings as
`reference.silu_mul_ref`): one program per (row, BLOCK columns), fp32 math, silu rounded to the input dtype
before the product, as the two torch ops round."""
import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < width
    g = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    u = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    silu = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (rows may be strided, columns contiguous) → [T, I]."""
    num_rows, double = gate_up.shape
    if double % 2:
        raise ValueError(f"silu_mul: the fused width {double} is odd")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    width = double // 2
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(width))
    _silu_mul_kernel[(num_rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                             width, BLOCK_I=block, num_warps=4)
    return out
