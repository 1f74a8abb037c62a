"""Triton MoE routing: softmax, top-k and renormalisation of one token's router logits in one program (same
signature as the reference). Replaces the five kernels of the torch path (softmax, topk, sum, div, casts) in a
decode step, where each costs more in launch than in work.

Per token (one program, E ≤ BLOCK_E logits in registers), in fp32:
    m = max l,  Z = Σ exp(l - m)
    K times: pick the largest remaining logit (the lowest id among equals), w = exp(l - m) / Z, mask it out
    renormalise: w_j ← w_j / Σ_j w_j
Ordering by logits equals ordering by softmax probabilities (exp is monotone), so the chosen experts are the
reference's up to ties; the weights agree to fp32 rounding. Whatever the logits (NaN, ±inf), the ids are K
distinct experts < E: the expert kernels index weights with them.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_lt,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALISE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    real = e < num_experts
    logit = tl.load(logits_ptr + t * stride_lt + e, mask=real, other=float("-inf")).to(tl.float32)
    logit = tl.where(logit == logit, logit, float("-inf"))    # NaN (a diverged model) never picked over numbers
    m = tl.max(logit, 0)
    z = tl.sum(tl.exp(logit - m), 0)
    slot = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], tl.float32)
    chosen_id = tl.zeros([BLOCK_K], tl.int64)
    open_ = real                                               # experts not chosen yet
    for j in tl.static_range(TOP_K):
        remaining = tl.where(open_, logit, float("-inf"))
        best = tl.max(remaining, 0)
        # the lowest open id among the largest: an expert id < E even when every logit left is -inf
        best_id = tl.min(tl.where(open_ & (remaining == best), e, BLOCK_E), 0)
        chosen_w = tl.where(slot == j, tl.exp(best - m) / z, chosen_w)
        chosen_id = tl.where(slot == j, best_id.to(tl.int64), chosen_id)
        open_ = open_ & (e != best_id)
    if RENORMALISE:
        chosen_w = chosen_w / tl.sum(chosen_w, 0)
    ok = slot < TOP_K
    tl.store(weights_ptr + t * TOP_K + slot, chosen_w, mask=ok)
    tl.store(ids_ptr + t * TOP_K + slot, chosen_id, mask=ok)


def moe_route_triton(
    logits: torch.Tensor,   # [T, E]
    top_k: int,
    renormalise: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] fp32, ids [T, K] int64
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"moe_route: top_k {top_k} must be in 1..{num_experts} (the number of experts)")
    if logits.stride(-1) != 1:
        raise ValueError(f"moe_route: logits need a contiguous last dimension (strides {logits.stride()})")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                     BLOCK_E=triton.next_power_of_2(num_experts),
                                     BLOCK_K=triton.next_power_of_2(top_k), RENORMALISE=renormalise,
                                     num_warps=4 if num_experts > 128 else 1)
    return weights, ids
