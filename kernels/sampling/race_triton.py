"""Triton exponential race: argmax_v l(v) − log E(v), E(v) = −log u(seed, t, stream, v), over a vocab-wide row.

Same signature and numbers as `reference.exponential_race` (Philox4x32-10 with key = seed, counter =
(token, position, stream, 0); u = (top 23 bits + 0.5) / 2^23). Grid (rows, splits): each program scans its
slice of the vocabulary in BLOCK-wide chunks and keeps the best (score, index); a tiny torch reduction over the
splits follows. Many splits keep the GPU busy at batch 1 (a 248k vocabulary is 1 MB of fp32 logits per row).
Ties resolve to the lowest index, as torch.argmax does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
SPLIT = 8192          # vocabulary entries per program


@triton.jit
def _race_kernel(logits_ptr, stride_row, seeds_ptr, positions_ptr, best_ptr, index_ptr, vocab, stream,
                 num_splits, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i_row, i_split = tl.program_id(0), tl.program_id(1)
    seed = tl.load(seeds_ptr + i_row)                                    # int64 key
    position = tl.load(positions_ptr + i_row).to(tl.uint32)
    b_best = float("-inf")
    b_index = i_split * SPLIT
    for start in range(i_split * SPLIT, i_split * SPLIT + SPLIT, BLOCK):
        o_v = start + tl.arange(0, BLOCK)
        m_v = o_v < vocab
        b_l = tl.load(logits_ptr + i_row.to(tl.int64) * stride_row + o_v, mask=m_v, other=float("-inf"))
        c0 = o_v.to(tl.uint32)
        zero = c0 * 0
        bits, _, _, _ = tl.philox(seed, c0, zero + position, zero + stream, zero)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)       # (0, 1): 23 bits + 0.5 over 2^23
        score = tl.where(m_v, b_l.to(tl.float32) - tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(score, axis=0)
        j = tl.argmax(score, axis=0)
        take = m > b_best                                                # strict: earlier chunks win ties
        b_index = tl.where(take, start + j, b_index)
        b_best = tl.where(take, m, b_best)
    tl.store(best_ptr + i_row * num_splits + i_split, b_best)
    tl.store(index_ptr + i_row * num_splits + i_split, b_index)


def exponential_race_triton(log_weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                            stream: int) -> torch.Tensor:
    """log_weights [R, V] (fp32/bf16, −inf: never drawn); seeds, positions [R] int64 → [R] int64."""
    rows, vocab = log_weights.shape
    log_weights = log_weights.contiguous()
    num_splits = triton.cdiv(vocab, SPLIT)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=log_weights.device)
    index = torch.empty(rows, num_splits, dtype=torch.int32, device=log_weights.device)
    if rows:
        _race_kernel[(rows, num_splits)](log_weights, log_weights.stride(0), seeds.long().contiguous(),
                                         positions.long().contiguous(), best, index, vocab, stream, num_splits,
                                         SPLIT=SPLIT, BLOCK=BLOCK)
    return index.gather(1, best.argmax(1, keepdim=True))[:, 0].long()
