"""Routed experts of a sparse MoE block (and the gated shared expert's combine), dispatched by device and size:
CUDA tensors run Triton (imported on first use): a GEMV per token-expert pair for a few pairs (decode and verify
steps), the grouped GEMMs over pairs sorted by expert above; everything else the torch loop over experts."""
import torch

from .reference import moe_experts_ref

# Up to this many token-expert pairs (tokens x top-k) the per-pair GEMVs run; above, the grouped GEMMs, which read
# each reached expert once (bench/README.md, "MoE decode").
DECODE_MAX_PAIRS = 64


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K] fp32, topk_ids [T, K] (and the shared
    expert's output [T, H] with its gate logit [T, 1]) → [T, H]:
    Σ_j w_j · down_e_j(silu(gate_e_j(x)) · up_e_j(x))  [+ sigmoid(shared_gate) · shared]."""
    if x.is_cuda:
        if topk_ids.numel() <= DECODE_MAX_PAIRS:
            from .triton_moe_decode import moe_experts_decode_triton
            return moe_experts_decode_triton(x, gate_up, down, topk_weights, topk_ids, shared, shared_gate)
        from .triton_moe import moe_experts_triton
        return moe_experts_triton(x, gate_up, down, topk_weights, topk_ids, shared, shared_gate)
    return moe_experts_ref(x, gate_up, down, topk_weights, topk_ids, shared, shared_gate)


__all__ = ["DECODE_MAX_PAIRS", "moe_experts", "moe_experts_ref"]
