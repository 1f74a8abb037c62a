"""Pure-torch SwiGLU activation over a fused gate/up projection: the CPU path and the Triton kernel's reference.

    silu_mul(gu) = silu(gu[:, :I]) · gu[:, I:]     silu rounded to the input dtype, then the product rounded
"""
import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] → [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
