"""Pure-torch paged causal attention over a ragged batch.

KV cache layout per attention layer: [num_blocks, block_size, num_kv_heads, head_dim]. Token at position p of
a sequence lives in block `block_tables[b, p // block_size]`, row `p % block_size`. Each query token attends
to every cached position <= its own position (causal), GQA heads share kv head h // (NH // NKV).
"""
import torch


def write_kv_ref(
    k: torch.Tensor,             # [T, NKV, D]
    v: torch.Tensor,             # [T, NKV, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    slot_mapping: torch.Tensor,  # [T] int64 flat index block * block_size + row
) -> None:
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,             # [T, NH, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    positions: torch.Tensor,     # [T] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens: torch.Tensor,    # [B + 1] int32
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:               # [T, NH, D]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        length = int(positions[end - 1]) + 1
        blocks = block_tables[b, : (length + block_size - 1) // block_size].long()
        keys = k_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, dim=1)    # [L, NH, D]
        values = v_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, dim=1)  # [L, NH, D]
        scores = torch.einsum("thd,lhd->htl", q[start:end].float(), keys) * scale              # [NH, n, L]
        allowed = torch.arange(length, device=q.device)[None, :] <= positions[start:end, None]  # [n, L]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[start:end] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values).to(q.dtype)
    return out
