"""Pure-torch RMSNorms of the Qwen3.5 / Qwen3-Next family (the CPU path and the reference of the Triton kernels).

    rms(x)          = x · rsqrt(mean(x²) + eps)                         in fp32
    rms_norm        = rms(x) · (1 + w)                                  zero-centred weight, then cast to x's dtype
    with residual:    s = x + residual (rounded to x's dtype, as the unfused add), y = rms_norm(s), returns (y, s)
    gated_rms_norm  = (w · rms(o) rounded to o's dtype, in o's dtype) · silu(z) in fp32, cast to o's dtype
Every norm works on the last dimension; leading dimensions are rows.
"""
import torch
import torch.nn.functional as F


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(
    x: torch.Tensor,                      # [..., H]
    weight: torch.Tensor,                 # [H] zero-centred: the scale is 1 + weight
    eps: float,
    residual: torch.Tensor | None = None,  # [..., H] the running residual stream, or None
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [..., H], residual_out [..., H]: x + residual, or x itself)
    if residual is not None:
        x = x + residual
    return (rms_normalize(x, eps) * (1.0 + weight.float())).to(x.dtype), x


def gated_rms_norm_ref(
    o: torch.Tensor,       # [T, HV, V] GDN output
    z: torch.Tensor,       # [T, HV, V] gate
    weight: torch.Tensor,  # [V] plain (not zero-centred)
    eps: float,
) -> torch.Tensor:         # [T, HV, V]
    normed = weight * rms_normalize(o, eps).to(o.dtype)
    return (normed * F.silu(z.float())).to(o.dtype)
