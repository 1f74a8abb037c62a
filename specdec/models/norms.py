"""RMSNorms of the Qwen3.5 / Qwen3-Next family.

Every RMSNorm is zero-centred, `x̂ · (1 + w)` computed in fp32, EXCEPT the GDN output norm, which is
`w · rmsnorm(o) · silu(z)` with a plain weight (DESIGN §2).
"""
import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: w · rmsnorm(o) · silu(z); normalisation in fp32, weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = self.weight * rms_normalize(o, self.eps).to(o.dtype)
        return (normed * F.silu(z.float())).to(o.dtype)
