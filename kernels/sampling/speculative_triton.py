"""Triton speculative sampling: the whole accept / emit rule of a step in one kernel launch.

Same signature and numbers as `reference.speculative_sample_ref` (read its docstring for the rule). Grid
(rows, splits); program (r, s) owns verify row r and the s-th SPLIT-wide slice of the vocabulary:

  scan      on a sampled row, the slice's part of the row's races, kept as (best score, index) partials:
              coupled draw   x_t = argmax_v l(v) − log E(v),  E(v) = −log u(seed, t, DRAW, v)
            and on a draft row whose drafter sent q (p = softmax l over the whole row, so these programs first
            read the row's max m and Z = Σ exp(l − m)):
              recovered      argmax_v log max(p − q, 0)(v) − log E'(v),  E' from the RECOVER stream
              fallback       argmax_v log p(v) − log E'(v)  (the reference races over p where p − q ≤ 0
                             everywhere)
            with Σ max(p − q, 0), Σ q and "q has a NaN / negative entry" over the slice.
            Greedy rows and the all-greedy call (logits None) scan nothing: their token is greedy_tokens[r].
  finalise  every program then adds 1 to its sequence's counter (acq_rel atomic, after a CTA barrier so the
            partials of all its threads are visible first). The program that brings the counter to
            (k_b + 1) · splits is the last of that sequence: it reduces the partials over the splits for each
            row, applies the rule row by row (accept while d_j == x_j, or u·q(d) < p(d) on valid-q rows), and
            writes the sequence's tokens (padded with −1), accepted count and row tokens.
Ties in a race resolve to the lowest token id (splits are contiguous and scanned in order), as torch.argmax does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
SPLIT = 8192                    # vocabulary entries per program
_BIG = 2 ** 30
_F, _I = 5, 4                   # float partials: race, residual race, fallback race, Σ residual, Σ q
                                # int partials: race index, residual index, fallback index, q invalid


@triton.jit
def _uniform(seed, c0, position, stream):
    """u(seed, t, stream, c0) in (0, 1): Philox4x32-10, top 23 bits + 0.5 over 2^23 (philox.bits_to_uniform)."""
    zero = c0 * 0
    bits, _, _, _ = tl.philox(seed, c0, zero + position, zero + stream, zero)
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _row_max_and_sum(row_ptr, vocab, BLOCK: tl.constexpr):
    """(m, Z) of a logit row: m = max l, Z = Σ exp(l − m) (online, one pass)."""
    b_m = tl.full([BLOCK], float("-inf"), tl.float32)
    b_z = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        b_l = tl.load(row_ptr + o_v, mask=o_v < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(b_m, b_l)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_z = b_z * tl.exp(b_m - safe) + tl.exp(b_l - safe)
        b_m = m_new
    m = tl.max(b_m, axis=0)
    z = tl.sum(b_z * tl.exp(b_m - m), axis=0)
    return m, z


@triton.jit
def _best_over_splits(f_ptr, i_ptr, num_splits, BLOCK_S: tl.constexpr):
    """The (index) of the largest partial score over the splits of one row, lowest index on ties."""
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    best = tl.load(f_ptr + o_s * 5, mask=m_s, other=float("-inf"), cache_modifier=".cg")
    index = tl.load(i_ptr + o_s * 4, mask=m_s, other=2 ** 30, cache_modifier=".cg")
    top = tl.max(best, axis=0)
    return tl.min(tl.where(m_s & (best == top), index, 2 ** 30), axis=0).to(tl.int64)


# Arguments whose values change from step to step (batch size, draft width, views into one upload buffer): not
# specialised, so the kernel compiles once per mode (greedy / sampled / q / forced), not per batch or alignment.
@triton.jit(do_not_specialize=["greedy_tokens_ptr", "drafts_ptr", "stride_d", "num_drafts_ptr", "cu_rows_ptr",
                               "greedy_ptr", "uses_q_ptr", "seeds_ptr", "offsets_ptr", "forced_ptr", "num_seqs",
                               "max_drafts"])
def _speculative_kernel(
        logits_ptr, stride_l, q_ptr, stride_q, greedy_tokens_ptr, drafts_ptr, stride_d, num_drafts_ptr,
        cu_rows_ptr, greedy_ptr, uses_q_ptr, seeds_ptr, offsets_ptr, forced_ptr,
        part_f_ptr, part_i_ptr, row_stats_ptr, counter_ptr, tokens_ptr, accepted_ptr, row_tokens_ptr,
        num_seqs, vocab, num_splits, max_drafts,
        HAS_LOGITS: tl.constexpr, HAS_Q: tl.constexpr, HAS_FORCED: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK: tl.constexpr):
    r, s = tl.program_id(0), tl.program_id(1)
    b = (r * 0).to(tl.int32)                                                # the row's sequence: ends <= r
    for at in range(0, num_seqs, BLOCK_B):
        o_b = at + tl.arange(0, BLOCK_B)
        ends = tl.load(cu_rows_ptr + 1 + o_b, mask=o_b < num_seqs, other=2 ** 62)
        b += tl.sum((ends <= r).to(tl.int32), axis=0)
    start = tl.load(cu_rows_ptr + b)
    k_b = tl.load(num_drafts_ptr + b)

    # ---- scan: this row's slice of the vocabulary ----
    if HAS_LOGITS:                                  # else greedy / seeds / offsets / uses_q are never read
        greedy = tl.load(greedy_ptr + b).to(tl.int32)
        seed = tl.load(seeds_ptr + b)
        offset = tl.load(offsets_ptr + b)
        if greedy == 0:
            j = r - start
            position = (offset + j).to(tl.uint32)
            row = logits_ptr + r.to(tl.int64) * stride_l
            part_f = part_f_ptr + (r * num_splits + s) * 5
            part_i = part_i_ptr + (r * num_splits + s) * 4
            lo = s * SPLIT
            b_best = float("-inf")
            b_index = lo
            for at in range(lo, lo + SPLIT, BLOCK):
                o_v = at + tl.arange(0, BLOCK)
                m_v = o_v < vocab
                b_l = tl.load(row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
                u = _uniform(seed, o_v.to(tl.uint32), position, 0)                  # DRAW
                score = tl.where(m_v, b_l - tl.log(-tl.log(u)), float("-inf"))
                top = tl.max(score, axis=0)
                take = top > b_best                                                 # earlier blocks win ties
                b_index = tl.where(take, at + tl.argmax(score, axis=0), b_index)
                b_best = tl.where(take, top, b_best)
            tl.store(part_f, b_best)
            tl.store(part_i, b_index)
            if HAS_Q:
                if (tl.load(uses_q_ptr + b).to(tl.int32) != 0) & (j < k_b):
                    m, z = _row_max_and_sum(row, vocab, BLOCK)
                    if s == 0:
                        tl.store(row_stats_ptr + r * 2, m)
                        tl.store(row_stats_ptr + r * 2 + 1, z)
                    q_row = q_ptr + r.to(tl.int64) * stride_q
                    res_best, res_index = float("-inf"), lo
                    all_best, all_index = float("-inf"), lo
                    res_sum, q_sum, q_bad = 0.0, 0.0, 0
                    for at in range(lo, lo + SPLIT, BLOCK):
                        o_v = at + tl.arange(0, BLOCK)
                        m_v = o_v < vocab
                        b_l = tl.load(row + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
                        b_q = tl.load(q_row + o_v, mask=m_v, other=0.0).to(tl.float32)
                        p = tl.exp(b_l - m) / z
                        residual = tl.maximum(p - b_q, 0.0)
                        log_e = tl.log(-tl.log(_uniform(seed, o_v.to(tl.uint32), position, 2)))  # RECOVER
                        score = tl.where(m_v, tl.log(residual) - log_e, float("-inf"))
                        top = tl.max(score, axis=0)
                        take = top > res_best
                        res_index = tl.where(take, at + tl.argmax(score, axis=0), res_index)
                        res_best = tl.where(take, top, res_best)
                        score = tl.where(m_v, tl.log(p) - log_e, float("-inf"))
                        top = tl.max(score, axis=0)
                        take = top > all_best
                        all_index = tl.where(take, at + tl.argmax(score, axis=0), all_index)
                        all_best = tl.where(take, top, all_best)
                        res_sum += tl.sum(tl.where(m_v, residual, 0.0), axis=0)
                        q_sum += tl.sum(b_q, axis=0)
                        bad = m_v & ((b_q != b_q) | (b_q < 0) | (tl.abs(b_q) == float("inf")))
                        q_bad = tl.maximum(q_bad, tl.max(bad.to(tl.int32), axis=0))
                    tl.store(part_f + 1, res_best)
                    tl.store(part_f + 2, all_best)
                    tl.store(part_f + 3, res_sum)
                    tl.store(part_f + 4, q_sum)
                    tl.store(part_i + 1, res_index)
                    tl.store(part_i + 2, all_index)
                    tl.store(part_i + 3, q_bad)

    # ---- the last program of the sequence decides it ----
    tl.debug_barrier()                                                      # all partial stores issued
    arrived = tl.atomic_add(counter_ptr + b, 1, sem="acq_rel")
    if arrived == (k_b + 1) * num_splits - 1:
        tl.debug_barrier()
        cols = tl.arange(0, BLOCK_W)
        accepts = tl.zeros([BLOCK_W], tl.int32)
        emits = tl.full([BLOCK_W], -1, tl.int64)
        for j in range(0, k_b + 1):
            row_j = start + j
            is_draft = j < k_b
            d = tl.load(drafts_ptr + b * stride_d + j, mask=is_draft, other=-1).to(tl.int64)
            target = tl.load(greedy_tokens_ptr + row_j).to(tl.int64)
            if HAS_LOGITS:
                if greedy == 0:
                    target = _best_over_splits(part_f_ptr + row_j * num_splits * 5,
                                               part_i_ptr + row_j * num_splits * 4, num_splits, BLOCK_S)
            accept = d == target
            emit = target
            if HAS_Q:
                if (greedy == 0) & (tl.load(uses_q_ptr + b).to(tl.int32) != 0) & is_draft:
                    o_s = tl.arange(0, BLOCK_S)
                    m_s = o_s < num_splits
                    f_row = part_f_ptr + row_j * num_splits * 5 + o_s * 5
                    res_sum = tl.sum(tl.load(f_row + 3, mask=m_s, other=0.0, cache_modifier=".cg"), axis=0)
                    q_sum = tl.sum(tl.load(f_row + 4, mask=m_s, other=0.0, cache_modifier=".cg"), axis=0)
                    q_bad = tl.max(tl.load(part_i_ptr + row_j * num_splits * 4 + o_s * 4 + 3, mask=m_s, other=0,
                                           cache_modifier=".cg"), axis=0)
                    m = tl.load(row_stats_ptr + row_j * 2, cache_modifier=".cg")
                    z = tl.load(row_stats_ptr + row_j * 2 + 1, cache_modifier=".cg")
                    d_safe = tl.minimum(tl.maximum(d, 0), vocab - 1)
                    p_d = tl.exp(tl.load(logits_ptr + row_j.to(tl.int64) * stride_l + d_safe).to(tl.float32) - m) / z
                    q_d = tl.load(q_ptr + row_j.to(tl.int64) * stride_q + d_safe).to(tl.float32)
                    q_ok = (q_bad == 0) & (q_d > 0) & (tl.abs(q_sum - 1.0) < 1e-3)
                    if q_ok:
                        u = _uniform(seed, (d_safe * 0).to(tl.uint32), (offset + j).to(tl.uint32), 1)  # ACCEPT
                        accept = u * q_d < p_d
                        if res_sum > 0:
                            emit = _best_over_splits(part_f_ptr + row_j * num_splits * 5 + 1,
                                                     part_i_ptr + row_j * num_splits * 4 + 1, num_splits, BLOCK_S)
                        else:
                            emit = _best_over_splits(part_f_ptr + row_j * num_splits * 5 + 2,
                                                     part_i_ptr + row_j * num_splits * 4 + 2, num_splits, BLOCK_S)
            accept = accept & is_draft
            accepts = tl.where(cols == j, accept.to(tl.int32), accepts)
            emits = tl.where(cols == j, emit, emits)
        num_accepted = tl.min(tl.where((accepts == 0) & (cols <= k_b), cols, BLOCK_W), axis=0).to(tl.int64)
        if HAS_FORCED:
            num_accepted = tl.minimum(tl.load(forced_ptr + b).to(tl.int64), k_b)
        emitted = tl.sum(tl.where(cols == num_accepted, emits, 0), axis=0)
        drafts = tl.load(drafts_ptr + b * stride_d + cols, mask=cols < max_drafts, other=-1).to(tl.int64)
        tokens = tl.where(cols < num_accepted, drafts, tl.where(cols == num_accepted, emitted, -1))
        tl.store(tokens_ptr + b * (max_drafts + 1) + cols, tokens, mask=cols < max_drafts + 1)
        tl.store(accepted_ptr + b, num_accepted)
        tl.store(row_tokens_ptr + start + cols, tokens, mask=cols <= k_b)


def speculative_sample_triton(
    logits: torch.Tensor | None, greedy_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
    drafts: torch.Tensor, num_drafts: torch.Tensor, cu_rows: torch.Tensor, greedy: torch.Tensor,
    uses_q: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, forced_accepts: torch.Tensor | None = None,
    split: int = SPLIT, block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculative_sample_ref's arguments and results (tokens [B, K+1], num_accepted [B], row_tokens [R]);
    `split` / `block` (powers of two, block <= split) only let tests cut a small vocabulary into several splits."""
    device = greedy_tokens.device
    num_seqs, max_drafts, num_rows = drafts.shape[0], drafts.shape[1], greedy_tokens.shape[0]
    long = dict(dtype=torch.int64, device=device)
    tokens = torch.empty(num_seqs, max_drafts + 1, **long)
    accepted = torch.empty(num_seqs, **long)
    row_tokens = torch.empty(num_rows, **long)
    if num_rows == 0:
        return tokens, accepted, row_tokens
    vocab = 1 if logits is None else logits.shape[1]
    num_splits = 1 if logits is None else triton.cdiv(vocab, split)
    if logits is not None:
        logits = logits.contiguous()
    has_q = logits is not None and draft_probs is not None
    q = draft_probs.contiguous() if has_q else greedy_tokens
    part_f = torch.empty(num_rows, num_splits, _F, dtype=torch.float32, device=device)
    part_i = torch.empty(num_rows, num_splits, _I, dtype=torch.int32, device=device)
    row_stats = torch.empty(num_rows, 2, dtype=torch.float32, device=device)
    counter = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    # the kernel indexes these per sequence / row with unit stride (copies only for strided views)
    greedy_tokens, drafts, num_drafts, cu_rows, greedy, uses_q, seeds, offsets = (
        t.contiguous() for t in (greedy_tokens, drafts, num_drafts, cu_rows, greedy, uses_q, seeds, offsets))
    if forced_accepts is not None:
        forced_accepts = forced_accepts.contiguous()
    _speculative_kernel[(num_rows, num_splits)](
        greedy_tokens if logits is None else logits, 0 if logits is None else logits.stride(0),
        q, q.stride(0) if has_q else 0, greedy_tokens, drafts, max(drafts.stride(0), 1), num_drafts, cu_rows,
        greedy, uses_q, seeds, offsets, greedy_tokens if forced_accepts is None else forced_accepts,
        part_f, part_i, row_stats, counter, tokens, accepted, row_tokens,
        num_seqs, vocab, num_splits, max_drafts,
        HAS_LOGITS=logits is not None, HAS_Q=has_q, HAS_FORCED=forced_accepts is not None,
        BLOCK_B=256, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_W=max(8, triton.next_power_of_2(max_drafts + 1)), SPLIT=split, BLOCK=block)
    return tokens, accepted, row_tokens


def greedy_accept_triton(argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, cu_rows: torch.Tensor,
                         forced_accepts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy.greedy_accept_ref's arguments and results: the kernel without logits, one program per row and no
    vocabulary work (the sampling state it would read is absent: num_drafts stands in for those pointers)."""
    tokens, accepted, _ = speculative_sample_triton(None, argmax, None, drafts, num_drafts, cu_rows, num_drafts,
                                                    num_drafts, num_drafts, num_drafts, forced_accepts)
    return tokens, accepted
