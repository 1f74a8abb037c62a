"""Partial rotary position embedding, neox style (rotate halves), on the first `rotary_dim` of each head; the
math lives in `kernels.rotary` (fused with the q/k norm).

Qwen3.5 text positions are 1-D: its MRoPE sections all see the same position, which reduces to this.
"""
import torch


class PartialRotary:
    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
        self.inv_freq = 1.0 / (theta ** exponents)  # [R/2] fp32, on the host until first use

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)  # once per device, not per call
        return self.inv_freq
