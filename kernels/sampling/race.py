"""The exponential race, a draw from norm(w): torch reference and the device dispatch to the Triton kernel."""
from __future__ import annotations

import torch

from .philox import uniforms

try:
    from .race_triton import exponential_race_triton
except ImportError:  # no Triton on this platform: the reference serves every device
    exponential_race_triton = None


def exponential_race_ref(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                         stream: int) -> torch.Tensor:
    """argmax_v w(v) / E(v) with E(v) = −log u(seed, t, stream, v) ~ Exp(1), computed as argmax_v log w(v) −
    log E(v). log_weights [R, V] (−inf: never drawn; at least one finite per row); seeds, positions [R]
    → [R] int64."""
    vocab = log_weights.shape[-1]
    exponential = -torch.log(uniforms(seeds, positions, stream, torch.arange(vocab, device=log_weights.device)))
    return (log_weights.float() - torch.log(exponential)).argmax(-1)


def exponential_race(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     stream: int) -> torch.Tensor:
    if log_weights.is_cuda and exponential_race_triton is not None:
        return exponential_race_triton(log_weights, seeds, positions, stream)
    return exponential_race_ref(log_weights, seeds, positions, stream)
