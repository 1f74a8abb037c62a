"""Pure-torch partial rotary embedding (neox style) and the q/k norm fused before it: the CPU path and the
reference of the Triton kernel.

    angle[t, i]  = positions[t] · inv_freq[i]                 fp32, i < R/2, R = rotary_dim = 2 · len(inv_freq)
    cos, sin     = cos/sin([angle, angle]) cast to x's dtype   [T, R]
    rope(x)[:R]  = x[:R] · cos + rotate_half(x[:R]) · sin      in x's dtype (each product and the sum rounded),
                   rotate_half(u) = [-u[R/2:], u[:R/2]]
    rope(x)[R:]  = x[R:]                                       the head's other dims pass through
    norm_rope(x) = rope(rms_norm(x, w, eps))                   the zero-centred per-head norm of kernels.rms_norm
"""
import torch

from kernels.rms_norm import rms_norm_ref


def rope_ref(
    x: torch.Tensor,          # [T, heads, D]
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,   # [R/2] fp32
) -> torch.Tensor:            # [T, heads, D]
    r = 2 * inv_freq.numel()
    freqs = positions[:, None].float() * inv_freq[None, :].float()                           # [T, R/2]
    angles = torch.cat([freqs, freqs], dim=-1)                                                # [T, R]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)    # [T, 1, R]
    rot, rest = x[..., :r], x[..., r:]
    rotated = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def norm_rope_ref(
    x: torch.Tensor,          # [T, heads, D], may be a strided view (q sliced out of [T, NH, 2D])
    weight: torch.Tensor,     # [D] zero-centred norm weight
    eps: float,
    positions: torch.Tensor,  # [T] int
    inv_freq: torch.Tensor,   # [R/2] fp32
) -> torch.Tensor:            # [T, heads, D] contiguous
    return rope_ref(rms_norm_ref(x, weight, eps)[0], positions, inv_freq)
