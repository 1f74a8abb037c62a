"""Rejection sampling of drafts against the target, for a ragged batch (DESIGN §3).

Words used everywhere:
  accepted  — leading drafts the target agrees with,
  recovered — the token emitted at the first rejected position, drawn from norm(max(p − q, 0)),
  bonus     — the token drawn from p at position k+1 when all k drafts are accepted.
Greedy rows accept while draft == argmax p, and emit argmax p. Random rows accept draft d with probability
min(1, p(d) / q(d)); q is one-hot for argmax drafters (so the test is u < p(d)) or the drafter's own
probabilities when it sends them. This keeps the output distributed exactly as the target's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import counter_uniform, sample_from, target_probs

ACCEPT_STREAM = 1 << 40  # uniform index space for acceptance tests, apart from token draws (row * V + v)


@dataclass
class SamplingBatch:
    """Per-sequence sampling state, as tensors on the logits' device. All [B]."""
    greedy: torch.Tensor       # bool
    temperature: torch.Tensor  # float32, 1 where greedy (unused)
    top_k: torch.Tensor        # int64
    top_p: torch.Tensor        # float32
    seeds: torch.Tensor        # int64
    offsets: torch.Tensor      # int64: tokens emitted so far, so each step draws fresh numbers


@dataclass
class Verdict:
    num_accepted: list[int]    # [B] accepted drafts per sequence
    tokens: list[list[int]]    # [B] emitted tokens: accepted drafts + one recovered or bonus token


def rejection_sample(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: list[int], sampling: SamplingBatch,
                     draft_probs: torch.Tensor | None = None, forced_accepts: list[int] | None = None) -> Verdict:
    """logits [R, V] fp32 with R = Σ(k_b + 1) rows, sequence b's rows are its k_b draft positions then the bonus
    position; drafts [Σ k_b] int64; draft_probs [Σ k_b, V] or None (one-hot). `forced_accepts` (benchmarks
    only) replaces the acceptance test by a given count; the emitted token is then drawn from p."""
    device, vocab = logits.device, logits.shape[-1]
    counts = torch.tensor([k + 1 for k in num_drafts], device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(len(num_drafts), device=device), counts)       # [R]
    first_row = torch.cumsum(counts, 0) - counts                                                     # [B]
    pos_in_seq = torch.arange(logits.shape[0], device=device) - first_row[seq_of_row]               # [R]
    is_draft_row = pos_in_seq < counts[seq_of_row] - 1                                               # [R]
    greedy = sampling.greedy[seq_of_row]                                                             # [R]

    probs = target_probs(logits, sampling.temperature[seq_of_row], sampling.top_k[seq_of_row],
                         sampling.top_p[seq_of_row])                                                 # [R, V]
    seeds, offsets = sampling.seeds[seq_of_row], sampling.offsets[seq_of_row]
    draft_of_row = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
    draft_of_row[is_draft_row] = drafts
    # Acceptance test per draft row.
    p_draft = probs.gather(-1, draft_of_row[:, None])[:, 0]                                          # [R]
    q_draft = torch.ones_like(p_draft)
    residual = probs.clone()
    if draft_probs is not None:
        q_rows = torch.zeros_like(probs)
        q_rows[is_draft_row] = draft_probs.float()
        q_draft = q_rows.gather(-1, draft_of_row[:, None])[:, 0]
        residual = (probs - q_rows).clamp_min(0)
    else:
        residual[is_draft_row] = residual[is_draft_row].scatter(-1, draft_of_row[is_draft_row, None], 0.0)
    u_accept = counter_uniform(seeds, offsets, (ACCEPT_STREAM + pos_in_seq)[:, None])[:, 0]         # [R]
    accept_random = u_accept * q_draft < p_draft                     # u < p/q without dividing by q = 0
    accept_greedy = draft_of_row == logits.argmax(-1)
    accepted = torch.where(greedy, accept_greedy, accept_random) & is_draft_row                      # [R]
    # Token drawn at every row: recovered from the residual on draft rows, bonus from p on the last row.
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), probs)
    from_dist = torch.where(is_draft_row[:, None], residual, probs)
    if forced_accepts is not None:
        from_dist = probs
    index = pos_in_seq[:, None] * vocab + torch.arange(vocab, device=device)[None, :]                # [R, V]
    drawn = sample_from(from_dist, counter_uniform(seeds, offsets, index))
    drawn = torch.where(greedy, logits.argmax(-1), drawn)                                             # [R]

    # One host transfer per step: acceptance flags, drawn tokens.
    accepted_host, drawn_host, drafts_host = accepted.tolist(), drawn.tolist(), drafts.tolist()
    num_accepted, tokens, row, d = [], [], 0, 0
    for b, k in enumerate(num_drafts):
        j = 0
        if forced_accepts is not None:
            j = min(forced_accepts[b], k)
        else:
            while j < k and accepted_host[row + j]:
                j += 1
        num_accepted.append(j)
        tokens.append(drafts_host[d:d + j] + [drawn_host[row + j]])
        row, d = row + k + 1, d + k
    return Verdict(num_accepted=num_accepted, tokens=tokens)
