"""Routed experts of a sparse MoE block, dispatched by device: CUDA tensors run the Triton grouped GEMMs (no host
sync; imported on first use), everything else the torch loop over experts."""
import torch

from .reference import moe_experts_ref


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K] fp32, topk_ids [T, K] → [T, H]:
    Σ_j w_j · down_e_j(silu(gate_e_j(x)) · up_e_j(x))."""
    if x.is_cuda:
        from .triton_moe import moe_experts_triton
        return moe_experts_triton(x, gate_up, down, topk_weights, topk_ids)
    return moe_experts_ref(x, gate_up, down, topk_weights, topk_ids)


__all__ = ["moe_experts", "moe_experts_ref"]
