"""Zero-centred RMSNorm (with the residual add fused) and the gated GDN output norm, dispatched by device.

CUDA tensors run the Triton kernels (imported on first use); everything else runs the torch reference.
"""
import torch

from .reference import gated_rms_norm_ref, rms_norm_ref, rms_normalize


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] → (rms(s)·(1 + w), s) with s = x + residual (or s = x without a residual)."""
    if x.is_cuda:
        from .triton_rms_norm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z [T, HV, V], weight [V] → w · rms(o) · silu(z)."""
    if o.is_cuda:
        from .triton_rms_norm import gated_rms_norm_triton
        return gated_rms_norm_triton(o, z, weight, eps)
    return gated_rms_norm_ref(o, z, weight, eps)


__all__ = ["gated_rms_norm", "gated_rms_norm_ref", "rms_norm", "rms_norm_ref", "rms_normalize"]
