"""Paged causal attention and KV writes: public entry points, dispatched by device.

CUDA tensors run the Triton kernels (imported on first use, so that a CPU process never compiles them and a
`TRITON_INTERPRET=1` test decides how they are built); everything else runs the torch reference.
"""
import torch

from .reference import paged_attention_ref, write_kv_ref

# Query tiles of 128 rows instead of 64: each key tile loaded serves twice the rows, which pays once the context
# outweighs the chunk. A step of up to q query tokens per sequence, for the largest q here at most its longest,
# takes them from that q's context tokens before every sequence's first query token (the crossovers of a sweep
# on an H200: bench/README.md, "Wider attention tiles deep into a prompt"); shorter steps never.
WIDE_TILE_CONTEXT = ((2048, 2048), (1024, 8192), (512, 16384))   # (q, context), q falling


def wide_tile_context(max_seqlen: int) -> int | None:
    """Tokens of context from which a step whose longest sequence has `max_seqlen` query tokens takes 128-row
    query tiles (None: never)."""
    return next((ctx for q, ctx in WIDE_TILE_CONTEXT if max_seqlen >= q), None)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                    out: torch.Tensor | None = None, min_context: int = 0) -> torch.Tensor:
    """q [T, NH, D], caches [num_blocks, block_size, NKV, D], positions [T] int64, block_tables [B, W] int32,
    cu_seqlens [B + 1] int32 → [T, NH, D]. Token t attends to its sequence's positions 0..positions[t].
    `min_context`: a host bound on the keys every sequence has before its first query token (0: unknown); it
    picks the query tiles, never the result."""
    if q.is_cuda:
        from .triton_paged_attention import paged_attention_triton
        return paged_attention_triton(q, k_cache, v_cache, positions, block_tables, cu_seqlens, max_seqlen,
                                      scale, out, min_context=min_context)
    return paged_attention_ref(q, k_cache, v_cache, positions, block_tables, cu_seqlens, max_seqlen, scale, out)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, NKV, D] → cache rows slot_mapping [T] (block * block_size + offset)."""
    if k.is_cuda:
        from .triton_write_kv import write_kv_triton
        return write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


__all__ = ["WIDE_TILE_CONTEXT", "paged_attention", "paged_attention_ref", "wide_tile_context", "write_kv",
           "write_kv_ref"]
