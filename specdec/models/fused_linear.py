"""Bias-free linears that read the same input, run as one GEMM.

Their weights are concatenated once loaded (`fuse_projections(model)`; else on first use, never inside a CUDA graph
capture) on the weights' device and dtype, and each linear's
weight becomes a view of its rows of the fused [sum of outputs, in] tensor: parameter names, state_dict and
memory stay as they were. The outputs come back as column slices of one [T, sum] result (row-strided views);
the kernels that read them take row strides. A linear whose weight was replaced since (load_state_dict with
assign, .to(dtype)) is seen on the next call and the rows are fused again; after a CUDA graph was captured over
the model that frees the rows the graph reads, so replace weights before capturing, never after.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    def __init__(self, *linears: nn.Linear):
        if any(linear.bias is not None for linear in linears):
            raise ValueError("FusedLinear: the linears must have no bias")
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.weight: torch.Tensor | None = None   # [sum(sizes), in]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [T, in] → one [T, size] view each
        return self.joined(x).split(self.sizes, dim=-1)

    def joined(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] → [T, sum(sizes)], the outputs side by side
        if not self.is_current():
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                # a concatenation captured into a graph would run at every replay, into the graph's pool
                raise RuntimeError("FusedLinear: weights not fused before CUDA graph capture; call "
                                   "fuse_projections(model) once the weights are loaded")
            self.fuse()
        return F.linear(x, self.weight)

    def is_current(self) -> bool:
        """Are the linears' weights still the rows of the fused tensor, in order, on its device and dtype?"""
        if self.weight is None:
            return False
        row_bytes = self.weight.shape[1] * self.weight.element_size()
        start = self.weight.data_ptr()
        for linear, size in zip(self.linears, self.sizes):
            w = linear.weight
            if w.data_ptr() != start or w.dtype != self.weight.dtype or w.device != self.weight.device:
                return False
            start += size * row_bytes
        return True

    def fuse(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([linear.weight.detach() for linear in self.linears])  # [sum(sizes), in]
            start = 0
            for linear, size in zip(self.linears, self.sizes):
                linear.weight = nn.Parameter(fused[start:start + size], requires_grad=False)
                start += size
        self.weight = fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every FusedLinear inside `model` now (after loading, before any CUDA graph capture). Returns how
    many there were. Rows already fused stay where they are: graphs captured over this model (by an earlier
    ModelRunner, say) read the fused weights by address, and fusing again would free what they read."""
    fused = [value for module in model.modules() for value in vars(module).values() if isinstance(value, FusedLinear)]
    for f in fused:
        if not f.is_current():
            f.fuse()
    return len(fused)
