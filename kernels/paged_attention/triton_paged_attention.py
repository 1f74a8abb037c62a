"""Triton paged causal attention for verify (k+1 query tokens per sequence) and chunked prefill.

Same signature and semantics as `reference.paged_attention_ref`.

One program owns (query tile, kv head h, KV split s). Its tile has ROWS = BLOCK_M tokens × GROUP_PAD query heads of
kv head h, so each KV tile is loaded once for every query head that shares it (GQA). The query tiles are numbered
flat over the batch: sequence b owns cdiv(len_b, BLOCK_M) of them, after those of sequences 0..b−1, and a program
finds its (b, query block m) from the prefix sums of cu_seqlens. So the grid holds at most T / BLOCK_M + B tiles,
not B × the longest sequence's: a step that mixes a prompt chunk with decoders (or pads a graph bucket with
sequences of no tokens) launches no program per (decoder, chunk block) that would only exit. Keys are
gathered through the block table position by position (any cache block_size works). Online softmax in the log2
domain, fp32 accumulators:
    m' = max(m, max_n s_n);  l' = l·2^(m−m') + Σ_n 2^(s_n−m');  acc' = acc·2^(m−m') + Σ_n 2^(s_n−m') v_n
with s = q·k · scale · log2(e), masked to keys at positions ≤ the row's own position (causal inside the block).
Key tiles that end before the tile's earliest row position skip the mask (`_attend_tile`'s MASKED = False): a
prompt chunk's query tile masks only its last few key tiles.
Invariant: the running max starts at −1e30 (finite), so a row that has seen only masked keys keeps m = −1e30,
l = 0, acc = 0 and never produces NaN; such rows are either padding (not stored) or get their keys later.

Split-KV (flash-decoding): when the grid would be too small to fill the GPU (decode / verify at small batch), the
key range of each query block is cut into NUM_SPLITS contiguous runs of tiles; each split stores its (acc, m, l)
and `_combine_kernel` merges them:  M = max_s m_s,  out = Σ_s acc_s 2^(m_s−M) / Σ_s l_s 2^(m_s−M).
The grid depends only on (T, B, max_seqlen, NKV, splits) — all host ints — so it is static for a CUDA-graph bucket.
"""
import functools

import torch
import triton
import triton.language as tl

from . import wide_tile_context

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
NEG_BIG = tl.constexpr(-1e30)  # finite "minus infinity" of the running max (see the invariant above)


@triton.jit
def _tile_rows(cu_seqlens_ptr, positions_ptr, q_tile, num_seqs, kv_head,
               BLOCK_M: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
               SEQS_PAD: tl.constexpr):
    """Rows of flat query tile `q_tile`: its sequence, flat token, query head, validity, and position (−1 for invalid
    rows). Sequence b's query tiles are numbered from Σ_{i<b} cdiv(len_i, BLOCK_M); a tile past the last is all
    invalid. SEQS_PAD ≥ num_seqs."""
    b = tl.arange(0, SEQS_PAD)
    lo = tl.load(cu_seqlens_ptr + b, mask=b < num_seqs, other=0)               # [SEQS_PAD]
    hi = tl.load(cu_seqlens_ptr + b + 1, mask=b < num_seqs, other=0)           # [SEQS_PAD]
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M                                  # [SEQS_PAD] query tiles per sequence
    ends = tl.cumsum(tiles, 0)                                                  # [SEQS_PAD] of sequences 0..b
    seq = tl.sum((ends <= q_tile).to(tl.int32), 0)                              # the first b whose tiles pass it
    rows = tl.arange(0, ROWS)
    live = (tl.full([ROWS], 0, tl.int32) + seq) < num_seqs                      # [ROWS]: not past the last tile
    seq = tl.minimum(seq, num_seqs - 1)
    m_block = q_tile - tl.sum(tl.where(b == seq, ends - tiles, 0), 0)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    row_tok = rows // GROUP_PAD
    row_grp = rows % GROUP_PAD
    tok = start + m_block * BLOCK_M + row_tok                                   # [ROWS] int32
    valid = (row_tok < BLOCK_M) & (row_grp < GROUP) & (tok < end) & live
    pos = tl.load(positions_ptr + tok, mask=valid, other=-1).to(tl.int64)       # [ROWS]
    head = kv_head * GROUP + row_grp
    return seq, tok.to(tl.int64), head.to(tl.int64), valid, pos


@triton.jit
def _attend_tile(b_q, k_cache_ptr, v_cache_ptr, p_table, tile, ctx_len, q_pos, m_i, l_i, acc, scale_log2e,
                 block_size, stride_cr, stride_cb, stride_ch, kv_head, d, d_ok,
                 BLOCK_N: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the online softmax. MASKED: the tile may hold keys past some row's position or past the
    context (the causal mask and the bounds applied); otherwise every key precedes every row's position."""
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                                   # [BLOCK_N] key positions
    n_ok = n < ctx_len
    blk = tl.load(p_table + n // block_size, mask=n_ok, other=0).to(tl.int64)
    o_kv = blk * stride_cb + (n % block_size).to(tl.int64) * stride_cr + kv_head * stride_ch   # [BLOCK_N]
    b_kt = tl.load(k_cache_ptr + o_kv[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    if IEEE:
        s = tl.dot(b_q, b_kt, input_precision="ieee")                              # [ROWS, BLOCK_N]
    else:
        s = tl.dot(b_q, b_kt)
    if MASKED:
        s = tl.where(n[None, :] <= q_pos[:, None], s * scale_log2e, float("-inf"))
    else:
        s = s * scale_log2e
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    b_v = tl.load(v_cache_ptr + o_kv[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
    return m_new, l_i, acc


# num_tokens, num_seqs and stride_bt (the step's widest block table) vary per step: not specialised on them, so a
# new value compiles no new variant (SEQS_PAD, num_seqs rounded up to a power of two, does)
@triton.jit(do_not_specialize=["num_tokens", "num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, block_tables_ptr, cu_seqlens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2e, block_size, num_tokens, num_seqs, num_heads,
    stride_qt, stride_qh, stride_cb, stride_cr, stride_ch, stride_ot, stride_oh, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SEQS_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    seq, tok, head, valid, q_pos = _tile_rows(cu_seqlens_ptr, positions_ptr, tl.program_id(0), num_seqs, kv_head,
                                              BLOCK_M, GROUP, GROUP_PAD, ROWS, SEQS_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    p_q = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    b_q = tl.load(p_q, mask=valid[:, None] & d_ok[None, :], other=0.0)          # [ROWS, BLOCK_D]
    b_q = b_q.to(k_cache_ptr.dtype.element_ty)

    # keys 0..ctx_len-1 cover every row of the block (positions rise inside a sequence)
    ctx_len = (tl.max(q_pos, axis=0) + 1).to(tl.int32)
    num_tiles = tl.cdiv(ctx_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    # keys 0 .. first_masked·BLOCK_N − 1 precede every valid row's position: those tiles need no causal mask
    first_masked = ((tl.min(tl.where(valid, q_pos, ctx_len), axis=0) + 1) // BLOCK_N).to(tl.int32)
    m_i = tl.full([ROWS], NEG_BIG, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    p_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tl.minimum(tile_hi, first_masked)):
        m_i, l_i, acc = _attend_tile(b_q, k_cache_ptr, v_cache_ptr, p_table, tile, ctx_len, q_pos, m_i, l_i, acc,
                                     scale_log2e, block_size, stride_cr, stride_cb, stride_ch, kv_head, d, d_ok,
                                     BLOCK_N, IEEE, False)
    for tile in range(tl.maximum(tile_lo, first_masked), tile_hi):
        m_i, l_i, acc = _attend_tile(b_q, k_cache_ptr, v_cache_ptr, p_table, tile, ctx_len, q_pos, m_i, l_i, acc,
                                     scale_log2e, block_size, stride_cr, stride_cb, stride_ch, kv_head, d, d_ok,
                                     BLOCK_N, IEEE, True)

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        p_o = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(p_o, o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])
    else:
        # partials [NUM_SPLITS, T, NH, ...]; an empty split stores only (m, l) = (−1e30, 0)
        row_id = (split * num_tokens + tok) * num_heads + head                      # [ROWS] int64
        tl.store(part_ml_ptr + row_id * 2, m_i, mask=valid)
        tl.store(part_ml_ptr + row_id * 2 + 1, l_i, mask=valid)
        has_keys = valid & (tl.full([ROWS], 0, tl.int32) + tile_hi > tile_lo)     # [ROWS]
        p_acc = part_acc_ptr + row_id[:, None] * HEAD_DIM + d[None, :]
        tl.store(p_acc, acc, mask=has_keys[:, None] & d_ok[None, :])


# num_tokens and num_seqs vary per step: not specialised on them (SEQS_PAD is)
@triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
def _combine_kernel(
    cu_seqlens_ptr, positions_ptr, out_ptr, part_acc_ptr, part_ml_ptr, num_tokens, num_seqs, num_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, SEQS_PAD: tl.constexpr,
):
    kv_head = tl.program_id(1)
    _, tok, head, valid, _ = _tile_rows(cu_seqlens_ptr, positions_ptr, tl.program_id(0), num_seqs, kv_head,
                                        BLOCK_M, GROUP, GROUP_PAD, ROWS, SEQS_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m_run = tl.full([ROWS], NEG_BIG, tl.float32)
    l_run = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for split in range(NUM_SPLITS):
        row_id = (split * num_tokens + tok) * num_heads + head
        m_s = tl.load(part_ml_ptr + row_id * 2, mask=valid, other=NEG_BIG)
        l_s = tl.load(part_ml_ptr + row_id * 2 + 1, mask=valid, other=0.0)
        a_s = tl.load(part_acc_ptr + row_id[:, None] * HEAD_DIM + d[None, :],
                      mask=valid[:, None] & d_ok[None, :] & (l_s > 0)[:, None], other=0.0)
        m_new = tl.maximum(m_run, m_s)
        alpha, beta = tl.exp2(m_run - m_new), tl.exp2(m_s - m_new)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    p_o = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(p_o, o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a block may use (the interpreter: as an H100's)."""
    if device.type != "cuda":
        return 227 * 1024
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter runs: small, but > 1 so tests exercise split-KV
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(num_seqs: int, max_seqlen: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  device: torch.device, num_splits: int | None = None, tuning: dict | None = None,
                  kv_bytes: int = 2, num_tokens: int | None = None, min_context: int = 0) -> dict:
    """Tile sizes and split count: host ints only (static for a CUDA-graph bucket). Query tiles of 64 rows, of 128 from
    `min_context` >= wide_tile_context(max_seqlen) keys before every sequence's first query. Key tiles of 64, but of
    32 for head_dim 256 under fewer than 64 query rows (decode / verify tiles) or where the query tile and two
    stages of 64-key K and V tiles of `kv_bytes` elements would not fit the device's shared memory with 16 KiB to
    spare (fp32 caches; GPUs with less than an H100's); a prompt chunk's 64-row tiles take 64 keys
    (`bench/kernels.py --attention-prefill` sweeps the choices). `tuning` (that sweep) overrides any of rows (query
    rows of a tile), block_n, num_warps, num_stages. `num_tokens`: the step's T (default num_seqs × max_seqlen),
    which bounds the flat query tiles. Splits: enough for about 2 programs per SM, or 4 in a step of several
    sequences whose tiles span several query blocks (a prompt chunk beside decoders, several prompts at once): its
    tiles are nearly all a chunk's, each walking its whole context, so they get what a 512-token chunk alone
    gets."""
    tuning = tuning or {}
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    shared = _shared_memory(device)

    def fits_64_keys(query_rows: int) -> bool:   # the query tile and two stages of 64-key K and V tiles, 16 KiB spare
        return (query_rows + 2 * 2 * 64) * block_d * kv_bytes + 16 * 1024 <= shared
    # 128 rows where they fit (not fp32 caches at D = 256); the fp32 acc [rows, D] lives in registers (8 warps)
    threshold = wide_tile_context(max_seqlen)
    wide = threshold is not None and min_context >= threshold and fits_64_keys(128)
    tokens_per_tile = max(1, tuning.get("rows", 128 if wide else 64) // group_pad)
    block_m = min(triton.next_power_of_2(max(1, max_seqlen)), tokens_per_tile)
    rows = max(16, block_m * group_pad)                           # tl.dot needs M ≥ 16
    m_blocks = triton.cdiv(max(1, max_seqlen), block_m)
    num_tokens = num_seqs * max_seqlen if num_tokens is None else num_tokens
    num_q_tiles = max(1, min(num_seqs * m_blocks, triton.cdiv(num_tokens, block_m) + num_seqs))
    if num_splits is None:
        per_sm = 4 if num_seqs > 1 and m_blocks > 1 else 2
        want = triton.cdiv(per_sm * _num_sms(device), num_q_tiles * num_kv_heads)
        num_splits = min(MAX_SPLITS, triton.next_power_of_2(want)) if want > 1 else 1
    block_n = 32 if block_d >= 256 and (rows < 64 or not fits_64_keys(rows)) else 64
    return dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_D=block_d, BLOCK_M=block_m, ROWS=rows,
                SEQS_PAD=max(2, triton.next_power_of_2(num_seqs)),
                BLOCK_N=tuning.get("block_n", block_n), NUM_SPLITS=num_splits, num_q_tiles=num_q_tiles,
                num_warps=tuning.get("num_warps", 8 if rows * block_d >= 64 * 256 else 4),
                num_stages=tuning.get("num_stages", 2))


def paged_attention_triton(
    q: torch.Tensor,             # [T, NH, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    v_cache: torch.Tensor,       # [num_blocks, block_size, NKV, D]
    positions: torch.Tensor,     # [T] int64
    block_tables: torch.Tensor,  # [B, W] int32
    cu_seqlens: torch.Tensor,    # [B + 1] int32
    max_seqlen: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tuning: dict | None = None,
    min_context: int = 0,        # keys every sequence has before its first query (host bound; picks the tiles)
) -> torch.Tensor:               # [T, NH, D]
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_attention: k_cache / v_cache need the same strides and contiguous head_dim")
    if block_tables.stride(-1) != 1:
        raise ValueError("paged_attention: block_tables rows must be contiguous")
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs == 0 or num_tokens == 0:
        return out
    cfg = launch_config(num_seqs, max_seqlen, num_heads, num_kv_heads, head_dim, q.device, num_splits, tuning,
                        k_cache.element_size(), num_tokens, min_context)
    splits, num_q_tiles = cfg.pop("NUM_SPLITS"), cfg.pop("num_q_tiles")
    num_warps, block_n, num_stages = cfg.pop("num_warps"), cfg.pop("BLOCK_N"), cfg.pop("num_stages")
    part_acc = part_ml = out  # unused placeholders when there is a single split
    if splits > 1:
        part_acc = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(num_q_tiles, num_kv_heads * splits)](
        q, k_cache, v_cache, positions, block_tables, cu_seqlens, out, part_acc, part_ml,
        scale * LOG2E, block_size, num_tokens, num_seqs, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_SPLITS=splits, IEEE=k_cache.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages, **cfg)
    if splits > 1:
        _combine_kernel[(num_q_tiles, num_kv_heads)](
            cu_seqlens, positions, out, part_acc, part_ml, num_tokens, num_seqs, num_heads, out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=splits, num_warps=4, **cfg)
    return out
