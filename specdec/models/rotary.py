"""Partial rotary position embedding, neox style (rotate halves), on the first `rotary_dim` of each head.

Qwen3.5 text positions are 1-D: its MRoPE sections all see the same position, which reduces to this.
"""
import torch


class PartialRotary:
    def __init__(self, head_dim: int, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [R/2], on the host until first use

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)  # once per device, not per call
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, R/2]
        angles = torch.cat([freqs, freqs], dim=-1)                                          # [T, R]
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos/sin: [T, R]."""
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half1, half2 = rot[..., : r // 2], rot[..., r // 2:]
        rotated = torch.cat([-half2, half1], dim=-1)
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
