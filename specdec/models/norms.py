"""RMSNorms of the Qwen3.5 / Qwen3-Next family (the math lives in `kernels.rms_norm`).

Every RMSNorm is zero-centred, `x̂ · (1 + w)` computed in fp32, EXCEPT the GDN output norm, which is
`w · rmsnorm(o) · silu(z)` with a plain weight (docs/architecture.md, "The model").
"""
import torch
from torch import nn

from kernels.rms_norm import gated_rms_norm, rms_norm


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused into the norm: s = x + residual (s = x when residual is None) →
        (norm(s), s). Decoder layers carry s as the residual stream, so the adds are no separate ops."""
        return rms_norm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """GDN output norm: w · rmsnorm(o) · silu(z); normalisation in fp32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [T, HV, V] each
        return gated_rms_norm(o, z, self.weight, self.eps)
