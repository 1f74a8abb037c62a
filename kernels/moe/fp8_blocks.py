"""FP8 routed experts in the MoE kernels: float8_e4m3fn weights with block scales (reference.ExpertScales), turned
into the model's dtype tile by tile as they are read, so a step reads one byte per weight.

A weight tile covers output rows n (any) and the reduction columns k0 .. k0 + BLOCK_K − 1; with BLOCK_K dividing
the block's column count b1 (and k0 a multiple of BLOCK_K) those columns lie in one scale block, so the tile needs
one scale per output row:
    w[n, k] = e4m3[n, k] · scale[e, n // b0, k0 // b1]
rounded to the model's dtype, as the reference dequantizes (the kernels then compute as on plain weights).
"""
from dataclasses import dataclass

import torch
import triton  # noqa: F401  (triton.jit below)
import triton.language as tl

from .reference import ExpertScales


@triton.jit
def row_scales(scale_ptr, expert, rows, rows_ok, k0, stride_se, stride_sr, B0: tl.constexpr, B1: tl.constexpr):
    """[len(rows)] fp32 scales of weight rows `rows` of `expert` for the column block holding k0."""
    return tl.load(scale_ptr + expert * stride_se + (rows // B0).to(tl.int64) * stride_sr + k0 // B1,
                   mask=rows_ok, other=0.0)


@dataclass(frozen=True)
class ScaleOperands:
    """What the kernels take for FP8 experts: SCALED, the two scale tensors (the weights themselves when not
    scaled: never read then), their expert and row strides, and the block (b0, b1)."""
    scaled: bool
    gate_up: torch.Tensor    # [E, ceil(2I / b0), ceil(H / b1)] float32 scales (scaled), else the gate_up weights
    down: torch.Tensor       # [E, ceil(H / b0), ceil(I / b1)] float32 scales (scaled), else the down weights
    block: tuple[int, int]   # (b0, b1); (1, 1) when not scaled

    def gate_up_args(self) -> tuple:
        return (self.gate_up, self.gate_up.stride(0), self.gate_up.stride(1)) if self.scaled else (self.gate_up, 0, 0)

    def down_args(self) -> tuple:
        return (self.down, self.down.stride(0), self.down.stride(1)) if self.scaled else (self.down, 0, 0)


def scale_operands(scales: ExpertScales | None, gate_up: torch.Tensor, down: torch.Tensor,
                   block_k: int) -> ScaleOperands:
    """The operands of `scales` (None: plain experts); ValueError when a tile of `block_k` columns would straddle
    two scale blocks or the weights are not e4m3."""
    if scales is None:
        return ScaleOperands(False, gate_up, down, (1, 1))
    if gate_up.dtype != torch.float8_e4m3fn or down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"moe_experts: scales go with float8_e4m3fn experts, not {gate_up.dtype} / {down.dtype}")
    if scales.block[1] % block_k:
        raise ValueError(f"moe_experts: {block_k}-column tiles straddle the FP8 blocks of {scales.block[1]} columns")
    return ScaleOperands(True, scales.gate_up.float().contiguous(), scales.down.float().contiguous(), scales.block)


def block_k_for(scales: ExpertScales | None, block_k: int) -> int:
    """block_k, halved (down to 16) until it divides the scale blocks' column count (block_k when plain;
    scale_operands refuses what still does not)."""
    while scales is not None and block_k > 16 and scales.block[1] % block_k:
        block_k //= 2
    return block_k
