"""The speculative rule of one verify step, on the device: logits of the verify rows → accepted drafts and the
emitted token of every sampled sequence, in one entry point (`sample`), for every kind of request.

Rows of sequence b are its k_b draft positions then its bonus position (R = Σ (k_b + 1)). The words, as in
docs/sampling.md: a draft is *accepted* while the target agrees; at the first rejection the target's own token is
emitted (*recovered*); when every draft is accepted the token after them is the *bonus*.
  - every request greedy, none with penalties or logprobs: argmax per row and the leading run of drafts equal to
    it (kernels.sampling.greedy_accept, one launch);
  - otherwise, per row: penalties (counting the drafts before the row), temperature / top-k / top-p / min-p
    (processors.py), then kernels.sampling.speculative_sample: the coupled draw x = argmax p / E for one-hot
    drafters and greedy rows, min(1, p/q) with a residual draw for drafters that send q; draws keyed by (seed,
    output position), never by batch row.
`sample` reads nothing from the device: the engine copies the verdict to the host and reads it once (in_flight.py,
one step late when steps overlap); logprobs, asked for only in synchronous steps, are read with it
(`DeviceLogprobs.read`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling import greedy_accept, speculative_sample
from kernels.sampling.reference import row_layout
from specdec.grammar import RowMasks, mask_rows

from .batch import SamplingBatch
from .processors import Penalties, RowParams, apply_penalties, processed_logits


@dataclass
class VerifyRows:
    """The drafts a step verifies, per sampled sequence (all on the device)."""
    drafts: torch.Tensor           # [S, K] int64, padded with -1
    num_drafts: torch.Tensor       # [S] int64
    cu_rows: torch.Tensor          # [S + 1] int64: sequence b's rows are cu_rows[b] .. cu_rows[b + 1] - 1
    width: int                     # K, the most drafts of any sequence (host)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class DeviceLogprobs:
    """Per row (device): the emitted-or-drafted token's logprob and the top-n alternatives, under the row's
    processed distribution."""
    chosen: torch.Tensor           # [R] float32
    top_logprobs: torch.Tensor     # [R, n] float32
    top_ids: torch.Tensor          # [R, n] int64
    row_tokens: torch.Tensor       # [R] int64
    cu_rows: torch.Tensor          # [S + 1] int64
    wanted: list[int | None]       # [S] n per sequence (host), None: no logprobs

    def read(self, num_accepted: list[int]) -> list[list[TokenLogprob] | None]:
        """Each sequence's emitted tokens' logprobs (tokens cut by top-k / top-p / min-p have logprob −inf and are
        left out of the alternatives). Reads the device."""
        chosen, top_logp, top_ids = self.chosen.tolist(), self.top_logprobs.tolist(), self.top_ids.tolist()
        row_tokens, starts = self.row_tokens.tolist(), self.cu_rows.tolist()
        out: list[list[TokenLogprob] | None] = []
        for b, n in enumerate(self.wanted):
            if n is None:
                out.append(None)
                continue
            rows = range(starts[b], starts[b] + num_accepted[b] + 1)
            out.append([TokenLogprob(row_tokens[r], chosen[r],
                                     [i for i, lp in zip(top_ids[r][:n], top_logp[r][:n]) if lp != float("-inf")],
                                     [lp for lp in top_logp[r][:n] if lp != float("-inf")]) for r in rows])
        return out


@dataclass
class DeviceVerdict:
    """The verdict of a step's sampled sequences, on the device."""
    tokens: torch.Tensor                 # [S, W] int64: accepted drafts, then the emitted token, padded with -1
    accepted: torch.Tensor | None        # [S] int64 accepted drafts; None when no sequence verified drafts
    logprobs: DeviceLogprobs | None = None


def sample(logits: torch.Tensor, rows: VerifyRows, sampling: SamplingBatch | None,
           draft_probs: torch.Tensor | None = None, forced_accepts: torch.Tensor | None = None,
           token_masks: RowMasks | None = None) -> DeviceVerdict:
    """logits [R, V] fp32 of the sampled sequences' rows. `sampling` None: every sequence is greedy without
    penalties or logprobs (no sampling state is built). draft_probs [R, V]: q on the draft rows of sequences
    with sampling.uses_q, else None. `forced_accepts` [S] (benchmarks only) imposes the accepted count; the
    emitted token is still the target's. `token_masks`: the tokens the grammar of each constrained row allows
    (specdec/grammar.py); the others get logit −inf before anything else, so every rule below samples from the
    masked distribution and a draft the grammar refuses is never accepted."""
    if token_masks is not None:
        logits = mask_rows(logits, token_masks.rows, token_masks.bits)
    if sampling is None:
        argmax = logits.argmax(-1)                                                              # [R]
        if rows.width == 0:      # plain decoding: one row per sequence, its argmax is the token
            return DeviceVerdict(argmax[:, None], None)
        tokens, accepted = greedy_accept(argmax, rows.drafts, rows.num_drafts, rows.cu_rows, forced_accepts)
        return DeviceVerdict(tokens, accepted)
    vocab, num_rows = logits.shape[-1], logits.shape[0]
    seq_of_row, pos = row_layout(rows.cu_rows, num_rows)
    if sampling.penalised:
        logits = apply_penalties(logits, _penalties(sampling, rows.drafts, seq_of_row, pos, vocab))
    processed = None
    if not sampling.all_greedy or sampling.max_logprobs is not None:
        params = RowParams(greedy=sampling.greedy[seq_of_row], temperature=sampling.temperature[seq_of_row],
                           top_k=sampling.top_k[seq_of_row], top_p=sampling.top_p[seq_of_row],
                           min_p=sampling.min_p[seq_of_row])
        processed = processed_logits(logits, params, sort=sampling.truncates)                    # [R, V]
    tokens, accepted, row_tokens = speculative_sample(
        processed, logits.argmax(-1), draft_probs, rows.drafts, rows.num_drafts, rows.cu_rows, sampling.greedy,
        sampling.uses_q, sampling.seeds, sampling.offsets, forced_accepts)
    logprobs = None
    if sampling.max_logprobs is not None:
        logp = processed.log_softmax(-1)
        top_logp, top_ids = logp.topk(max(sampling.max_logprobs, 1), dim=-1)                      # [R, n]
        chosen = logp.gather(-1, row_tokens.clamp(min=0)[:, None])[:, 0]                         # [R]
        logprobs = DeviceLogprobs(chosen, top_logp, top_ids, row_tokens, rows.cu_rows, sampling.logprobs)
    return DeviceVerdict(tokens, accepted if rows.width else None, logprobs)


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
