"""Rejection sampling of one engine step: logits of the verify rows → accepted drafts and emitted tokens.

Rows of sequence b are its k_b draft positions then the bonus position (R = Σ (k_b + 1)). Per row: penalties
(counting the drafts before the row), temperature / top-k / top-p / min-p (logits_processors), then the
accept / emit rule of kernels.sampling (coupled draw for one-hot drafters, min(1, p/q) for drafters that send
q, argmax for greedy rows). Vectorised over rows; the step's one host transfer happens at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.sampling import greedy_accept, speculative_sample
from kernels.sampling.reference import row_layout

from .logits_processors import Penalties, RowParams, apply_penalties, processed_logits
from .sampling_batch import SamplingBatch


BeforeSync = Callable[[torch.Tensor | None], None]   # accepted counts [B] on the device (None: all zero)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Verdict:
    num_accepted: list[int]                          # [B] accepted drafts per sequence
    tokens: list[list[int]]                          # [B] accepted drafts + one recovered or bonus token
    logprobs: list[list[TokenLogprob] | None]        # [B] per emitted token, for sequences that asked


def _rows(num_drafts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_rows [B+1], seq_of_row [R], pos [R]) for k_b + 1 rows per sequence."""
    cu_rows = torch.nn.functional.pad(torch.cumsum(num_drafts + 1, 0), (1, 0))
    return (cu_rows, *row_layout(cu_rows, num_rows))


def _penalties(s: SamplingBatch, drafts: torch.Tensor, seq_of_row: torch.Tensor, pos: torch.Tensor,
               vocab: int) -> Penalties:
    """Per-row counts: the sequence's output counts plus its drafts before the row (exclusive prefix)."""
    width = drafts.shape[1]
    before = torch.arange(width, device=drafts.device)[None, :] < pos[:, None]               # [R, K]
    ids = torch.where(before & (drafts[seq_of_row] >= 0), drafts[seq_of_row], vocab)           # [R, K]
    extra = torch.zeros(pos.shape[0], vocab + 1, dtype=torch.int32, device=drafts.device)
    extra.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return Penalties(output_counts=s.output_counts[seq_of_row] + extra[:, :vocab],
                     prompt_mask=s.prompt_mask[seq_of_row], repetition=s.repetition[seq_of_row],
                     presence=s.presence[seq_of_row], frequency=s.frequency[seq_of_row])


def rejection_sample(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, sampling: SamplingBatch,
                     draft_probs: torch.Tensor | None = None, forced_accepts: torch.Tensor | None = None,
                     before_sync: BeforeSync | None = None) -> Verdict:
    """logits [R, V] fp32; drafts [B, K] int64 padded with -1; num_drafts [B] int64; draft_probs [R, V] (q on
    the draft rows of sequences with sampling.uses_q) or None. `forced_accepts` [B] (benchmarks only) imposes
    the accepted count; the emitted token is still the target's. `before_sync` gets the accepted counts [B] on the
    device before the host reads them (to queue work that depends on them)."""
    tokens, num_accepted, row_tokens, processed, cu_rows = decide_on_device(logits, drafts, num_drafts, sampling,
                                                                            draft_probs, forced_accepts)
    if before_sync is not None:
        before_sync(num_accepted)
    host = torch.cat([tokens, num_accepted[:, None]], dim=1).tolist()                         # the one sync
    logprobs = [None] * len(host)
    if sampling.max_logprobs is not None:
        logprobs = _logprobs(processed.log_softmax(-1), row_tokens, cu_rows, [row[-1] for row in host], sampling)
    return _verdict(host, logprobs)


def decide_on_device(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, sampling: SamplingBatch,
                     draft_probs: torch.Tensor | None = None, forced_accepts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """rejection_sample up to its host read: (tokens [B, K+1] padded with -1, accepted [B], row tokens [R],
    processed logits [R, V] or None when every row is greedy without logprobs, cu_rows [B+1]), all on the device.
    The launched (overlapped) steps use it alone."""
    vocab, num_rows = logits.shape[-1], logits.shape[0]
    cu_rows, seq_of_row, pos = _rows(num_drafts, num_rows)
    if sampling.penalised:
        logits = apply_penalties(logits, _penalties(sampling, drafts, seq_of_row, pos, vocab))
    processed = None
    if not sampling.all_greedy or sampling.max_logprobs is not None:
        rows = RowParams(greedy=sampling.greedy[seq_of_row], temperature=sampling.temperature[seq_of_row],
                         top_k=sampling.top_k[seq_of_row], top_p=sampling.top_p[seq_of_row],
                         min_p=sampling.min_p[seq_of_row])
        processed = processed_logits(logits, rows, sort=sampling.truncates)                   # [R, V]
    tokens, num_accepted, row_tokens = speculative_sample(
        processed, logits.argmax(-1), draft_probs, drafts, num_drafts, cu_rows, sampling.greedy, sampling.uses_q,
        sampling.seeds, sampling.offsets, forced_accepts)
    return tokens, num_accepted, row_tokens, processed, cu_rows


def greedy_verdict(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, cu_rows: torch.Tensor,
                   forced_accepts: torch.Tensor | None = None, before_sync: BeforeSync | None = None) -> Verdict:
    """rejection_sample's verdict when every sequence is greedy without penalties or logprobs: argmax per row
    and the leading run of drafts that match it (one Triton launch on CUDA). cu_rows [B+1] from
    kernels.sampling.cu_rows_of. `before_sync`: as in rejection_sample (None for the counts when there are no
    drafts)."""
    if drafts.shape[1] == 0:  # plain decoding: one row per sequence, its argmax is the token (one launch)
        argmax = logits.argmax(-1)
        if before_sync is not None:
            before_sync(None)
        return Verdict(num_accepted=[0] * drafts.shape[0], tokens=[[t] for t in argmax.tolist()],
                       logprobs=[None] * drafts.shape[0])
    tokens, num_accepted = greedy_accept(logits.argmax(-1), drafts, num_drafts, cu_rows, forced_accepts)
    if before_sync is not None:
        before_sync(num_accepted)
    return _verdict(torch.cat([tokens, num_accepted[:, None]], dim=1).tolist(), [None] * drafts.shape[0])


def _verdict(host: list[list[int]], logprobs: list) -> Verdict:
    """host rows [tokens padded with -1 ..., num_accepted] → the Verdict."""
    accepted = [row[-1] for row in host]
    return Verdict(num_accepted=accepted, tokens=[row[:j + 1] for row, j in zip(host, accepted)], logprobs=logprobs)


def _logprobs(logp: torch.Tensor, row_tokens: torch.Tensor, cu_rows: torch.Tensor, accepted: list[int],
              sampling: SamplingBatch) -> list[list[TokenLogprob] | None]:
    """Each emitted token's logprob under its row's processed distribution, and the top-n alternatives
    (tokens cut by top-k / top-p / min-p have logprob −inf and are left out)."""
    chosen = logp.gather(-1, row_tokens.clamp(min=0)[:, None])[:, 0]                           # [R]
    top_logp, top_ids = logp.topk(max(sampling.max_logprobs, 1), dim=-1)                       # [R, n]
    chosen, top_logp, top_ids = chosen.tolist(), top_logp.tolist(), top_ids.tolist()
    row_tokens, starts = row_tokens.tolist(), cu_rows.tolist()
    out: list[list[TokenLogprob] | None] = []
    for b, n in enumerate(sampling.logprobs):
        if n is None:
            out.append(None)
            continue
        rows = range(starts[b], starts[b] + accepted[b] + 1)
        out.append([TokenLogprob(row_tokens[r], chosen[r],
                                 [i for i, lp in zip(top_ids[r][:n], top_logp[r][:n]) if lp != float("-inf")],
                                 [lp for lp in top_logp[r][:n] if lp != float("-inf")]) for r in rows])
    return out
