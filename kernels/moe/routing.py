"""Token-expert pairs sorted by expert into padded row blocks, on the device with no host sync.

Pair p = t·K + j is token t's j-th choice. Each expert's pairs fill whole blocks of `block_m` rows (the last one
padded with the sentinel P = T·K), and experts follow each other in id order. Sizes depend only on host ints
(T, K, E, block_m), so the buffers are static inside a CUDA graph:
    max_rows  = P + min(E, P)·(block_m − 1)      at most min(E, P) experts are used, each wastes < block_m rows
    sorted_pairs  [max_rows]            pair id of each row, P for padding
    block_experts [max_rows / block_m]  expert of each block, E for blocks past the used ones
"""
import torch


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def sort_pairs_by_expert(topk_ids: torch.Tensor,   # [T, K]
                         num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()                                                   # [P]
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))                                  # [E]
    padded = (counts + block_m - 1) // block_m * block_m                                 # [E]
    padded_end = padded.cumsum(0)                                                        # [E]
    order = torch.argsort(flat, stable=True)                                             # [P] pairs by expert
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank                                       # [P] row of each pair
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # E past the end
    return sorted_pairs, block_experts
