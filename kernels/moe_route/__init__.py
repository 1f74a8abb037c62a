"""MoE routing (softmax → top-k → optional renormalisation), dispatched by device: CUDA tensors run the one-launch
Triton kernel (imported on first use), everything else the torch reference."""
import torch

from .reference import moe_route_ref


def moe_route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] → (weights [T, K] fp32, ids [T, K] int64), the K largest softmax probabilities, descending."""
    if logits.is_cuda:
        from .triton_moe_route import moe_route_triton
        return moe_route_triton(logits, top_k, renormalise)
    return moe_route_ref(logits, top_k, renormalise)


__all__ = ["moe_route", "moe_route_ref"]
