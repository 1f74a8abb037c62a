"""Bias-free linears that read the same input, run as one GEMM.

Their weights are concatenated once loaded (`fuse_projections(model)`; else on first use, never inside a CUDA graph
capture) on the weights' device and dtype, and each linear's
weight becomes a view of its rows of the fused [sum of outputs, in] tensor: parameter names, state_dict and
memory stay as they were. The outputs come back as column slices of one [T, sum] result (row-strided views);
the kernels that read them take row strides. A linear whose weight was replaced since (load_state_dict with
assign, .to(dtype)) is seen on the next call and the rows are fused again; after a CUDA graph was captured over
the model that frees the rows the graph reads, so replace weights before capturing, never after.

FP8 linears (fp8_linear.Fp8Linear) fuse alike, their block scales too: each part but the last starts on a scale
block (B0 rows), so a part whose size is not a multiple of B0 is followed by zero rows whose output columns are
skipped. Linears of both kinds in one group (a module left unconverted) are not fused: each runs on its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_linear import fp8_linear


class FusedLinear:
    def __init__(self, *linears: nn.Module):
        if any(linear.bias is not None for linear in linears):
            raise ValueError("FusedLinear: the linears must have no bias")
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.offsets = self._offsets(None)         # each linear's first row (output column) in the fused result
        self.weight: torch.Tensor | None = None    # [rows, in]; FP8: float8_e4m3fn
        self.scale_inv: torch.Tensor | None = None  # FP8: [rows / B0, ceil(in / B1)]
        self.block: tuple[int, int] | None = None   # FP8: the scale block
        self.apart = False                          # FP8 and unconverted linears: each runs on its own

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x [T, in] → one [T, size] view each
        return self._parts(self._output(x))

    def joined(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] → [T, sum(sizes)], the outputs side by side
        out = self._output(x)                                                   # [T, rows]
        return out if out.shape[-1] == sum(self.sizes) else torch.cat(self._parts(out), dim=-1)

    def _parts(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [T, rows] → one [T, size] view each
        return tuple(out[..., offset:offset + size] for offset, size in zip(self.offsets, self.sizes))

    def plain_weight(self) -> torch.Tensor | None:
        """The fused [sum(sizes), in] weight when the linears run as one plain GEMM with it (a kernel may read it
        directly); None when they are FP8 or run apart."""
        self._fuse_if_stale(self.linears[0].weight.is_cuda)
        return None if self.apart or self.scale_inv is not None else self.weight

    def _fuse_if_stale(self, on_cuda: bool) -> None:
        if not self.is_current():
            if on_cuda and torch.cuda.is_current_stream_capturing():
                # a concatenation captured into a graph would run at every replay, into the graph's pool
                raise RuntimeError("FusedLinear: weights not fused before CUDA graph capture; call "
                                   "fuse_projections(model) once the weights are loaded")
            self.fuse()

    def _output(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in] → [T, rows]
        self._fuse_if_stale(x.is_cuda)
        if self.apart:
            return torch.cat([linear(x) for linear in self.linears], dim=-1)
        if self.scale_inv is not None:
            return fp8_linear(x, self.weight, self.scale_inv, self.block)
        return F.linear(x, self.weight)

    def replace_linears(self, replaced: dict[int, nn.Module]) -> None:
        """Take the replacements (id of an old linear → its new module) of to_fp8_linears; fuse again later."""
        if any(id(linear) in replaced for linear in self.linears):
            self.linears = tuple(replaced.get(id(linear), linear) for linear in self.linears)
            self.weight = self.scale_inv = self.block = None
            self.apart = False

    def is_current(self) -> bool:
        """Are the linears' weights still the rows of the fused tensor, in order, on its device and dtype?"""
        if self.weight is None:
            return self.apart
        row_bytes = self.weight.shape[1] * self.weight.element_size()
        start = self.weight.data_ptr()
        for linear, offset in zip(self.linears, self.offsets):
            w = linear.weight
            if w.data_ptr() != start + offset * row_bytes or w.dtype != self.weight.dtype \
                    or w.device != self.weight.device:
                return False
        return True

    def _offsets(self, block_rows: int | None) -> list[int]:
        offsets, row = [], 0
        for size in self.sizes:
            offsets.append(row)
            row += -(-size // block_rows) * block_rows if block_rows else size
        return offsets

    def fuse(self) -> None:
        is_fp8 = [getattr(linear, "weight_scale_inv", None) is not None for linear in self.linears]
        blocks = {getattr(linear, "block", None) for linear in self.linears}
        if any(is_fp8) and (not all(is_fp8) or len(blocks) > 1):
            self.weight, self.scale_inv, self.block, self.apart = None, None, None, True
            self.offsets = self._offsets(None)
            return
        with torch.inference_mode(False), torch.no_grad():
            if all(is_fp8):
                self._fuse_fp8(blocks.pop())
                return
            fused = torch.cat([linear.weight.detach() for linear in self.linears])  # [sum(sizes), in]
            start = 0
            for linear, size in zip(self.linears, self.sizes):
                linear.weight = nn.Parameter(fused[start:start + size], requires_grad=False)
                start += size
        self.weight, self.scale_inv, self.block, self.apart = fused, None, None, False
        self.offsets = self._offsets(None)

    def _fuse_fp8(self, block: tuple[int, int]) -> None:
        self.offsets = self._offsets(block[0])
        num_rows = self.offsets[-1] + self.sizes[-1]
        first = self.linears[0]
        weight = torch.zeros(num_rows, first.in_features, dtype=first.weight.dtype,
                             device=first.weight.device)                             # [rows, in] e4m3
        scale_inv = torch.ones(-(-num_rows // block[0]), first.weight_scale_inv.shape[1], dtype=torch.float32,
                               device=first.weight.device)                           # [rows / B0, ceil(in / B1)]
        for linear, offset, size in zip(self.linears, self.offsets, self.sizes):
            weight[offset:offset + size] = linear.weight
            first_block, num_blocks = offset // block[0], linear.weight_scale_inv.shape[0]
            scale_inv[first_block:first_block + num_blocks] = linear.weight_scale_inv
            linear.weight = nn.Parameter(weight[offset:offset + size], requires_grad=False)
            linear.weight_scale_inv = scale_inv[first_block:first_block + num_blocks]
        self.weight, self.scale_inv, self.block, self.apart = weight, scale_inv, block, False


def fuse_projections(model: nn.Module) -> int:
    """Fuse every FusedLinear inside `model` now (after loading, before any CUDA graph capture). Returns how
    many there were. Rows already fused stay where they are: graphs captured over this model (by an earlier
    ModelRunner, say) read the fused weights by address, and fusing again would free what they read."""
    fused = [value for module in model.modules() for value in vars(module).values() if isinstance(value, FusedLinear)]
    for f in fused:
        if not f.is_current():
            f.fuse()
    return len(fused)
