"""Partial rotary embedding with the per-head q/k norm fused in front, dispatched by device.

CUDA tensors run the Triton kernel (imported on first use); everything else runs the torch reference.
"""
import torch

from .reference import norm_rope_ref, rope_ref


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] → rope(rms_norm(x) · (1 + w)) on the first 2 · len(inv_freq) dims of each head."""
    if x.is_cuda:
        from .triton_norm_rope import norm_rope_triton
        return norm_rope_triton(x, weight, eps, positions, inv_freq)
    return norm_rope_ref(x, weight, eps, positions, inv_freq)


__all__ = ["norm_rope", "norm_rope_ref", "rope_ref"]
