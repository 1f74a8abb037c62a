"""Pure-torch speculative sampling over a ragged batch of verify rows (docs/sampling.md); the GPU kernel's reference.

Sequence b owns rows cu_rows[b] .. cu_rows[b+1]-1: its k_b draft positions then the bonus position. Row j of b
decides the token at absolute output position t = offsets[b] + j. Words used everywhere:
  accepted  — leading drafts the target agrees with,
  recovered — the token emitted at the first rejected position,
  bonus     — the token emitted after all k_b drafts were accepted.

The target's own token at every row is the exponential race
    x_t = argmax_v p_t(v) / E(v),   E(v) = −log u(seed, t, DRAW, v)  ~ Exp(1),
which picks v with probability p_t(v). It is computed in log space, argmax_v l_t(v) − log E(v) over the
processed logits l_t (p_t = softmax l_t: the same argmax, no softmax needed); cut tokens have l = −inf and are
never picked. Greedy rows use x_t = argmax l_t instead.
  - one-hot drafters (argmax proposals), the COUPLED draw: accept d_t iff d_t == x_t, so P(accept) = p(d), and
    on rejection x_t follows p restricted to v ≠ d, i.e. norm(max(p − onehot(d), 0)): the standard rule exactly.
    The bonus is x at the next position. Plain decoding (k = 0) draws the same x_t, so a seeded request is
    token-identical with and without drafts, for any k, batch, preemption or drafter fallback.
  - drafters that sent q: accept d with probability min(1, p(d)/q(d)), i.e. u(seed, t, ACCEPT, 0)·q(d) < p(d);
    on rejection the recovered token races over norm(max(p − q, 0)) with the RECOVER stream; the bonus is x.
Randomness depends only on (seed, t, stream, token id): never on the row, the batch slot or the step count.
"""
from __future__ import annotations

import torch

from .philox import ACCEPT, DRAW, RECOVER, uniforms
from .race import exponential_race


def row_layout(cu_rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_of_row [R], pos [R]): which sequence each verify row belongs to and its index j within it.
    cu_rows [B + 1] row offsets; num_rows = cu_rows[-1], known on the host (no sync)."""
    seq_of_row = torch.repeat_interleave(torch.arange(cu_rows.shape[0] - 1, device=cu_rows.device), cu_rows.diff(),
                                         output_size=num_rows)
    return seq_of_row, torch.arange(num_rows, device=cu_rows.device) - cu_rows[seq_of_row]


def speculative_sample_ref(
    logits: torch.Tensor | None,      # [R, V] fp32 processed logits, cut tokens −inf (None: every row is greedy)
    greedy_tokens: torch.Tensor,      # [R] int64 argmax of the penalised logits (used on greedy rows)
    draft_probs: torch.Tensor | None, # [R, V] fp32 q on the draft rows of sequences with uses_q (else ignored)
    drafts: torch.Tensor,             # [B, K] int64 proposals, padded with -1 beyond num_drafts
    num_drafts: torch.Tensor,         # [B] int64 k_b <= K
    cu_rows: torch.Tensor,            # [B + 1] int64 row offsets: cu_rows[b+1] - cu_rows[b] = k_b + 1
    greedy: torch.Tensor,             # [B] bool
    uses_q: torch.Tensor,             # [B] bool: the drafter sent q (ignored on greedy rows and invalid q rows)
    seeds: torch.Tensor,              # [B] int64 in [0, 2^63)
    offsets: torch.Tensor,            # [B] int64 output tokens emitted before this step (position of row 0)
    forced_accepts: torch.Tensor | None = None,  # [B] int64 benchmarks only: accepted count imposed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, K+1] int64 padded with -1, num_accepted [B] int64, row_tokens [R] int64: the token
    each row stands for, i.e. its draft while accepted, then the emitted one, -1 after)."""
    device = greedy_tokens.device
    num_seqs, width = drafts.shape[0], drafts.shape[1] + 1
    num_rows = greedy_tokens.shape[0]
    seq_of_row, pos = row_layout(cu_rows, num_rows)                                            # [R], [R] j
    is_draft = pos < num_drafts[seq_of_row]                                                    # [R]
    draft = torch.where(is_draft, drafts[seq_of_row, pos.clamp(max=width - 2)], -1) \
        if width > 1 else torch.full_like(pos, -1)                                              # [R]
    seeds_r, positions = seeds[seq_of_row], offsets[seq_of_row] + pos

    target = greedy_tokens.clone()                                                             # [R] x_t
    emit, accept = target.clone(), draft == target                                             # one-hot rule
    if logits is not None:
        random_rows = ~greedy[seq_of_row]
        target = torch.where(random_rows, exponential_race(logits, seeds_r, positions, DRAW), target)
        emit, accept = target.clone(), draft == target
        if draft_probs is not None:
            probs = logits.softmax(-1)
            d = draft.clamp(min=0)[:, None]
            p_d, q_d = probs.gather(-1, d)[:, 0], draft_probs.gather(-1, d)[:, 0]
            # min(1, p/q) is the rule only for a distribution q with q(d) > 0: a row whose q is not one (NaN,
            # negative, not summing to 1, q(d) = 0) falls back to the coupled draw, exact for any proposal.
            # Greedy rows never use q: they accept while the draft is the argmax.
            q_ok = (torch.isfinite(draft_probs).all(-1) & (draft_probs >= 0).all(-1) & (q_d > 0)
                    & ((draft_probs.sum(-1) - 1).abs() < 1e-3))
            q_rows = uses_q[seq_of_row] & ~greedy[seq_of_row] & is_draft & q_ok
            u = uniforms(seeds_r, positions, ACCEPT, torch.zeros(1, dtype=torch.long, device=device))[:, 0]
            residual = (probs - draft_probs).clamp_min(0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
            recovered = exponential_race(residual.log(), seeds_r, positions, RECOVER)
            accept = torch.where(q_rows, u * q_d < p_d, accept)                                 # u < p/q, no divide
            emit = torch.where(q_rows, recovered, emit)
    accept &= is_draft

    grid = torch.zeros(num_seqs, width, dtype=torch.bool, device=device)                       # [B, K+1]
    grid[seq_of_row, pos] = accept
    num_accepted = grid.long().cumprod(-1).sum(-1)                                             # [B] leading run
    if forced_accepts is not None:
        num_accepted = torch.minimum(forced_accepts.to(num_accepted), num_drafts)
    cols = torch.arange(width, device=device)[None, :]                                         # [1, K+1]
    emitted = emit[(cu_rows[:-1] + num_accepted).clamp(max=num_rows - 1)]                       # [B]
    padded = torch.nn.functional.pad(drafts, (0, 1), value=-1)                                 # [B, K+1]
    tokens = torch.where(cols < num_accepted[:, None], padded,
                         torch.where(cols == num_accepted[:, None], emitted[:, None], -1))
    return tokens, num_accepted, tokens[seq_of_row, pos]
