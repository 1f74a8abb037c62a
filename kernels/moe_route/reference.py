"""Pure-torch MoE routing (the CPU path and the reference of the Triton kernel).

For token t with router logits l_t [E]:
    p = softmax(l_t) in fp32,  (w, e) = top-k of p (descending),  w ← w / Σ w  when `renormalise`
Qwen3.5-MoE always renormalises; Qwen3-Next follows its config's `norm_topk_prob`.
"""
import torch


def moe_route_ref(
    logits: torch.Tensor,   # [T, E] router logits (any float dtype)
    top_k: int,
    renormalise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] fp32, ids [T, K] int64
    probs = torch.softmax(logits.float(), dim=-1)                      # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)                           # [T, K]
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids
