"""Routed experts of a sparse MoE block (and the gated shared expert's combine), dispatched by device and size:
CUDA tensors run Triton (imported on first use): a GEMV per token-expert pair for a few pairs (decode and verify
steps), the grouped GEMMs over pairs sorted by expert above; everything else the torch loop over experts."""
import torch

from .reference import SharedExpert, moe_experts_ref

# The per-pair GEMVs run up to 2 pairs (tokens x top-k) per expert and at most this many pairs; above, the grouped
# GEMMs, which read each reached expert once. Measured crossover: 2 pairs per expert at 64 experts
# (bench/README.md, "MoE decode").
DECODE_MAX_PAIRS = 256


def runs_decode_kernels(num_pairs: int, num_experts: int) -> bool:
    return num_pairs <= min(2 * num_experts, DECODE_MAX_PAIRS)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared: SharedExpert | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K] fp32, topk_ids [T, K] (and the block's
    shared expert) → [T, H]:  Σ_j w_j · down_e_j(silu(gate_e_j(x)) · up_e_j(x))  [+ sigmoid(g) · shared(x)]."""
    if x.is_cuda:
        if runs_decode_kernels(topk_ids.numel(), gate_up.shape[0]):
            from .triton_moe_decode import moe_experts_decode_triton
            return moe_experts_decode_triton(x, gate_up, down, topk_weights, topk_ids, shared)
        from .triton_moe import moe_experts_triton
        return moe_experts_triton(x, gate_up, down, topk_weights, topk_ids, shared)
    return moe_experts_ref(x, gate_up, down, topk_weights, topk_ids, shared)


__all__ = ["DECODE_MAX_PAIRS", "SharedExpert", "moe_experts", "moe_experts_ref", "runs_decode_kernels"]
