"""Routed experts of a sparse MoE block (and the gated shared expert), dispatched by device and size. CUDA tensors
run Triton (imported on first use), by the step's token-expert pairs (tokens x top-k):
  - one token, or pairs at most a quarter of the experts (and at most 256): a GEMV per pair (decode; the shared
    expert fused in). A GEMV per pair reads an expert once per pair that reaches it; one token's pairs reach
    distinct experts, and at P <= E / 4 few experts are reached twice,
  - up to 1024: a program per (expert, tile) that finds its pairs in the routing ids (wide decode and verify; the
    shared expert fused in): each expert reached is read once, for a scan of the ids,
  - more: the grouped GEMMs over pairs sorted by expert (prompt chunks);
everything else runs the torch loop over experts. Crossovers measured on an H100 (bench/README.md, "MoE decode").
"""
import torch

from .reference import ExpertScales, SharedExpert, moe_experts_ref

DECODE_MAX_PAIRS = 256
SCAN_MAX_PAIRS = 1024


def experts_kernel(num_tokens: int, top_k: int, num_experts: int) -> str:
    """"decode", "scan" or "grouped": which Triton kernels run `num_tokens` x `top_k` pairs over `num_experts`
    experts."""
    num_pairs = num_tokens * top_k
    if num_pairs <= DECODE_MAX_PAIRS and (num_tokens == 1 or 4 * num_pairs <= num_experts):
        return "decode"
    return "scan" if num_pairs <= SCAN_MAX_PAIRS else "grouped"


def triton_experts(kernel: str):
    """The Triton function of `kernel` ("decode", "scan" or "grouped"; imported on first use): one signature,
    that of moe_experts."""
    if kernel == "decode":
        from .triton_moe_decode import moe_experts_decode_triton
        return moe_experts_decode_triton
    if kernel == "scan":
        from .triton_moe_scan import moe_experts_scan_triton
        return moe_experts_scan_triton
    from .triton_moe import moe_experts_triton
    return moe_experts_triton


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared: SharedExpert | None = None,
                scales: ExpertScales | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], topk_weights [T, K] fp32, topk_ids [T, K] (and the block's
    shared expert; `scales` for FP8 experts) → [T, H]:
        Σ_j w_j · down_e_j(silu(gate_e_j(x)) · up_e_j(x))  [+ sigmoid(g) · shared(x)].
    The ids must be experts in [0, E), as kernels.moe_route gives them: the kernels index weights with them."""
    if x.is_cuda:
        kernel = triton_experts(experts_kernel(topk_ids.shape[0], topk_ids.shape[1], gate_up.shape[0]))
        return kernel(x, gate_up, down, topk_weights, topk_ids, shared, scales)
    return moe_experts_ref(x, gate_up, down, topk_weights, topk_ids, shared, scales)


__all__ = ["DECODE_MAX_PAIRS", "SCAN_MAX_PAIRS", "ExpertScales", "SharedExpert", "experts_kernel", "moe_experts",
           "moe_experts_ref", "triton_experts"]
