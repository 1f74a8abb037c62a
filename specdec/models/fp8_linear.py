"""Linears and MoE routed experts that keep their FP8 weights on the device: one byte per weight read per token
instead of two.

`Fp8Linear` holds a linear's weight as Qwen's checkpoints store it (`weight` float8_e4m3fn [out, in], `weight_scale_inv`
float32 per block) and runs `kernels.fp8_linear` (a Triton kernel on CUDA, its torch reference elsewhere).
`to_fp8_linears(model, fmt, stored)` swaps every linear the format converts for one, after the checkpoint is loaded:
an FP8 checkpoint's own bytes where the loader kept them (`stored`), else the loaded weight quantized in 128 x 128
blocks (`--quantization fp8`). FusedLinears see the swap and fuse FP8 rows (fused_linear.py). `experts_to_fp8` does
the same for the MoE layers' routed experts (`SparseMoE.keep_experts_fp8`), from `stored_experts_of` (an FP8
checkpoint's experts as read, never dequantized) or quantized.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_linear import fp8_linear

from .checkpoint_keys import to_canonical
from .fp8 import SCALE_SUFFIX, Fp8Format, quantize_blocks
from .fused_linear import FusedLinear
from .mlp import SparseMoE
from .model_config import ModelConfig


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


def experts_to_fp8(model: nn.Module, fmt: Fp8Format,
                   stored: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
    """Hold the routed experts of each MoE layer in FP8 where `fmt` converts them (not in modules_to_not_convert)
    and the fused gate_up's blocks fall as the checkpoint's gate and up blocks do (expert width a multiple of the
    block's rows, as in every Qwen MoE model; else they stay dequantized): an FP8 checkpoint's own bytes and scales
    where `stored` has them, else quantized from the loaded weights. Returns how many layers."""
    stored = stored or {}
    moe = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoE)
           and _experts_in_fp8(fmt, name, tuple(m.experts_gate_up.shape))]
    for name, m in moe:
        m.keep_experts_fp8(fmt.block, {part: stored[f"{name}.{part}"] for part in ("experts_gate_up", "experts_down")
                                       if f"{name}.{part}" in stored})
    return len(moe)


def _experts_in_fp8(fmt: Fp8Format, mlp: str, gate_up_shape: tuple[int, ...]) -> bool:
    """Whether the MoE layer `mlp` holds its routed experts in FP8: `fmt` converts them and the expert width I
    (gate_up [E, 2I, H]) is a multiple of the block's rows, so that gate and up keep their own blocks when fused."""
    return fmt.converts(f"{mlp}.experts.gate_up_proj", gate_up_shape) and gate_up_shape[1] // 2 % fmt.block[0] == 0


def stored_experts_of(config: ModelConfig, fmt: Fp8Format, tensors: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str]]:
    """An FP8 checkpoint's routed experts of the target layers that hold them in FP8 (_experts_in_fp8), as it stores
    them, under our names: experts_gate_up / experts_down → (e4m3 [E, out, in], float32 scales [E, out/b0, in/b1]),
    gate and up stacked as their weights are (to_canonical); and the checkpoint tensors they were made of."""
    names = [k for k in tensors if ".experts" in k and not k.startswith("mtp.") and k + SCALE_SUFFIX in tensors]
    if not names:
        return {}, []
    weights = to_canonical(config, {k: tensors[k] for k in names})
    scales = to_canonical(config, {k: tensors[k + SCALE_SUFFIX] for k in names})
    layers = {k.rsplit(".", 1)[0] for k in weights if k.endswith(".experts_gate_up")
              and _experts_in_fp8(fmt, k.rsplit(".", 1)[0], tuple(weights[k].shape))}
    kept = {k: (weights[k].to(torch.float8_e4m3fn), scales[k].float()) for k in weights
            if k.rsplit(".", 1)[0] in layers and k in scales}
    consumed = [k for k in names if k.split(".experts", 1)[0] in layers]
    return kept, consumed + [k + SCALE_SUFFIX for k in consumed]
