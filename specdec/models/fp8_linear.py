"""Linears that keep their FP8 weights on the device: one byte per weight read per token instead of two.

`Fp8Linear` holds a linear's weight as Qwen's checkpoints store it (`weight` float8_e4m3fn [out, in], `weight_scale_inv`
float32 per block) and runs `kernels.fp8_linear` (a Triton kernel on CUDA, its torch reference elsewhere).
`to_fp8_linears(model, fmt, stored)` swaps every linear the format converts for one, after the checkpoint is loaded:
an FP8 checkpoint's own bytes where the loader kept them (`stored`), else the loaded weight quantized in 128 x 128
blocks (`--quantization fp8`). FusedLinears see the swap and fuse FP8 rows (fused_linear.py).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_linear import fp8_linear

from .fp8 import Fp8Format, quantize_blocks
from .fused_linear import FusedLinear


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = block
        self.weight = nn.Parameter(weight, requires_grad=False)          # [out, in] float8_e4m3fn
        self.register_buffer("weight_scale_inv", scale_inv)              # [ceil(out/B0), ceil(in/B1)] float32
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] → [..., out]
        return fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv,
                          self.block).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


def to_fp8_linears(model: nn.Module, fmt: Fp8Format,
                   stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                   only_stored: bool = False) -> int:
    """Replace each nn.Linear of `model` whose weight `fmt` converts by an Fp8Linear (the LM head, routers and the
    modules in fmt.not_converted stay: Fp8Format.converts). `stored`: weight name → (FP8 weight, scale_inv) to take
    as they are; only_stored: replace exactly those (an FP8 checkpoint's; Qwen3-Next's fused in_proj_qkvz /
    in_proj_ba, split at load, stay dequantized). Returns how many linears were replaced. Call before
    fuse_projections and before any CUDA graph capture."""
    stored = stored or {}
    swapped: dict[int, Fp8Linear] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        key = f"{name}.weight"
        if not (key in stored if only_stored else fmt.converts(key, tuple(module.weight.shape))):
            continue
        if key in stored:
            weight, scale_inv = stored[key]
            weight = weight.to(module.weight.device, torch.float8_e4m3fn)
            scale_inv = scale_inv.to(module.weight.device, torch.float32)
        else:
            weight, scale_inv = quantize_blocks(module.weight.detach(), fmt.block)
        fp8 = Fp8Linear(weight, scale_inv, fmt.block)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fp8)
        swapped[id(module)] = fp8
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, FusedLinear):
                value.replace_linears(swapped)
    return len(swapped)
