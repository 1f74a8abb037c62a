"""SwiGLU's activation, silu(gate) · up, over a fused [gate | up] projection, dispatched by device.

CUDA tensors run the Triton kernel (imported on first use); everything else runs the torch reference.
"""
import torch

from .reference import silu_mul_ref


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] → silu(gate_up[:, :I]) · gate_up[:, I:]  [T, I]."""
    if gate_up.is_cuda:
        from .triton_silu_mul import silu_mul_triton
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)


__all__ = ["silu_mul", "silu_mul_ref"]
