"""Triton write of this step's K and V rows into the paged cache (same signature as `reference.write_kv_ref`).

One program per token: row `slot_mapping[t]` of the flattened cache [num_blocks * block_size, NKV, D] receives
k[t] and v[t] (cast to the cache dtype). Padding tokens point at a scratch row, so every program writes.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cr, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    o_c = slot * stride_cr + h[:, None] * stride_ch + d[None, :]                       # [HEADS_PAD, BLOCK_D]
    b_k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + o_c, b_k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    b_v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + o_c, b_v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,             # [T, NKV, D]
    v: torch.Tensor,             # [T, NKV, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("write_kv: k_cache / v_cache need the same strides and contiguous head_dim")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv: k and v need a contiguous head_dim")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("write_kv: cache blocks must be contiguous rows (flat row = block * block_size + row)")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4)
