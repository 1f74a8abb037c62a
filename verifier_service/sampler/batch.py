"""The sampling state of one engine step's sequences, as tensors on the logits' device."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.grammar import Grammars, RowMasks, masks_array
from specdec.models.pinned_upload import PinnedUpload

from ..sequence import Sequence


@dataclass
class SamplingBatch:
    """Per sequence, all [B] unless said otherwise."""
    greedy: torch.Tensor              # bool
    temperature: torch.Tensor         # float32, 1 on greedy rows (their logprobs are taken at temperature 1)
    top_k: torch.Tensor               # int64, 0: off
    top_p: torch.Tensor               # float32, 1: off
    min_p: torch.Tensor               # float32, 0: off
    seeds: torch.Tensor               # int64
    offsets: torch.Tensor             # int64: output tokens emitted before this step (row 0's position)
    uses_q: torch.Tensor              # bool: the drafter sent its distribution q for these drafts
    repetition: torch.Tensor          # float32, 1: off
    presence: torch.Tensor            # float32, 0: off
    frequency: torch.Tensor           # float32, 0: off
    output_counts: torch.Tensor | None  # [B, V] int32 when penalised
    prompt_mask: torch.Tensor | None    # [B, V] bool when penalised
    all_greedy: bool                  # host facts, known without a sync
    penalised: bool
    truncates: bool                   # some row uses top-k or top-p (the processing sorts the vocabulary)
    logprobs: list[int | None]        # [B] top-n wanted per sequence
    max_logprobs: int | None

    @staticmethod
    def of(seqs: list[Sequence], uses_q: list[bool], vocab: int,
           uploads: tuple[PinnedUpload, PinnedUpload]) -> "SamplingBatch":
        """`uploads`: (floats, ints) host → device copiers, owned by the caller across steps."""
        params = [s.params for s in seqs]
        # one column per field ([6, B], [5, B]): each field a contiguous row of the upload
        floats = np.array([[1.0 if p.greedy else p.temperature, p.top_p, p.min_p, p.repetition_penalty,
                            p.presence_penalty, p.frequency_penalty] for p in params], np.float32).reshape(-1, 6).T
        ints = np.array([[p.greedy, p.top_k, s.seed, len(s.output_ids), q]
                         for p, s, q in zip(params, seqs, uses_q)], np.int64).reshape(-1, 5).T
        floats, ints = uploads[0](floats), uploads[1](ints)
        device = floats.device
        penalised = any(p.penalised for p in params)
        wanted = [p.logprobs for p in params]
        return SamplingBatch(
            greedy=ints[0].bool(), temperature=floats[0], top_k=ints[1], top_p=floats[1],
            min_p=floats[2], seeds=ints[2], offsets=ints[3], uses_q=ints[4].bool(),
            repetition=floats[3], presence=floats[4], frequency=floats[5],
            output_counts=_stack_counts(seqs, vocab, device) if penalised else None,
            prompt_mask=_stack_prompt_masks(seqs, vocab, device) if penalised else None,
            all_greedy=all(p.greedy for p in params), penalised=penalised,
            truncates=any(p.top_k > 0 or p.top_p < 1.0 for p in params), logprobs=wanted,
            max_logprobs=max((n for n in wanted if n is not None), default=None))


def _stack_counts(seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] int32 output counts; zeros for sequences without penalties (their penalties are neutral)."""
    zeros = torch.zeros(vocab, dtype=torch.int32, device=device)
    return torch.stack([s.penalty_state(vocab, device).output_counts if s.params.penalised else zeros
                        for s in seqs])


def _stack_prompt_masks(seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] bool prompt tokens; all False for sequences without penalties."""
    none = torch.zeros(vocab, dtype=torch.bool, device=device)
    return torch.stack([s.penalty_state(vocab, device).prompt_mask if s.params.penalised else none for s in seqs])


def draft_probs_rows(sampled: list, uses_q: list[bool], logits: torch.Tensor) -> torch.Tensor | None:
    """[R, V] q on the draft rows of the scheduled sequences whose drafter sent it (zeros elsewhere), else None.
    `sampled`: the step's ScheduledSeqs that sample, in row order (k_b draft rows + 1 bonus row each)."""
    if not any(uses_q):
        return None
    q = torch.zeros_like(logits)
    row = 0
    for p, has_q in zip(sampled, uses_q):
        if has_q:
            q[row:row + p.num_drafts] = p.seq.draft_probs[:p.num_drafts].to(q)
        row += p.num_drafts + 1
    return q


def grammar_row_masks(sampled: list, grammars: Grammars | None, vocab: int,
                      uploads: tuple[PinnedUpload, PinnedUpload]) -> RowMasks | None:
    """The allowed tokens of the constrained sequences' verify rows (bitmasks on the device), None when no
    sequence has a grammar. `sampled`: the step's ScheduledSeqs that sample, in row order; their drafts are the
    host's (the last num_drafts tokens of each chunk: constrained steps with drafts are synchronous). `uploads`:
    (rows, bitmasks) host → device copiers, owned by the caller across steps."""
    firsts = np.cumsum([0] + [p.num_drafts + 1 for p in sampled])[:-1]
    # (a sequence that ended at an early read of the step before has rows here that nobody reads: left open)
    constrained = [(p, int(first)) for p, first in zip(sampled, firsts)
                   if p.seq.grammar is not None and p.seq.finish_reason is None]
    if not constrained:
        return None
    sizes = [p.num_drafts + 1 for p, _ in constrained]
    masks = masks_array(sum(sizes), vocab)
    grammars.fill_masks([(p.seq.grammar, int(at), p.chunk[len(p.chunk) - p.num_drafts:])
                         for (p, _), at in zip(constrained, np.cumsum([0] + sizes)[:-1])], masks)
    rows = np.concatenate([np.arange(first, first + n) for (_, first), n in zip(constrained, sizes)])
    return RowMasks(uploads[0](rows.astype(np.int64)), uploads[1](masks.numpy()))
