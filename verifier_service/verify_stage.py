"""The verify stage of a step: the sampler (sampler/) run on the step's logit rows, queued on the device.

For each sampled sequence of the step it lays out the rows the sampler reads: its drafts (read back from the staged
input ids on the device: written there from the unread step when steps overlap, never seen by the host), how many,
and where its k + 1 logit rows start; then the grammar masks of constrained rows, the sampling state (seeds,
temperatures, penalties' offsets) and the drafter's q where a synchronous step has one. Forced acceptance
(benchmarks) draws each verify step's accepted count here too. Host → device copies go through pinned buffers, so
nothing here waits for the device.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kernels.sampling import cu_rows_of
from specdec.grammar import Grammars
from specdec.models.pinned_upload import PinnedUpload

from .forced_acceptance import ForcedAcceptance
from .in_flight import InFlightStep, unread_emitted
from .sampler import DeviceVerdict, SamplingBatch, VerifyRows, draft_probs_rows, grammar_row_masks, sample
from .scheduler import ScheduledSeq


class VerifyStage:
    def __init__(self, device: torch.device, grammars: Grammars | None, forced: ForcedAcceptance | None):
        self.grammars, self.forced = grammars, forced
        self._upload_rows = PinnedUpload(device)
        self._upload_sampling = (PinnedUpload(device), PinnedUpload(device))
        self._upload_masks = (PinnedUpload(device), PinnedUpload(device))   # rows, bitmasks

    def forced_counts(self, sampled: list[ScheduledSeq]) -> list[int] | None:
        """Forced acceptance (benchmarks): each verify step's count, keyed by the request's seed and how many
        verify steps it launched before, so every path draws the same schedule."""
        if not self.forced:
            return None
        return self.forced.draw([(p.seq.seed, p.seq.verify_launches) for p in sampled])

    def verdict(self, entries: list[ScheduledSeq], sampled: list[ScheduledSeq], logits: torch.Tensor,
                input_ids: torch.Tensor, forced: list[int] | None, unread: InFlightStep | None,
                overlap: bool) -> DeviceVerdict:
        """The sampler on this step's logit rows ([R, V]: k_b + 1 per sampled entry) over its staged input ids
        ([T], the flat batch). Overlapped steps verify drafts made on the device, always one-hot: a q a drafter sent
        in an earlier synchronous step is not theirs."""
        s, chosen = len(sampled), {id(p) for p in sampled}   # (not p.samples: an early read has moved the counts)
        starts = np.cumsum([0] + [len(p.chunk) for p in entries])[:-1]
        firsts = np.fromiter((at + 1 for at, p in zip(starts, entries) if id(p) in chosen), np.int64, count=s)
        num_drafts = np.fromiter((p.num_drafts for p in sampled), np.int64, count=s)
        width = int(num_drafts.max(initial=0))
        cols = np.arange(width)[None, :]
        where = np.where(cols < num_drafts[:, None], firsts[:, None] + cols, -1)              # [S, K] flat index
        host = [where.ravel(), num_drafts, cu_rows_of(num_drafts)] + ([] if forced is None else [np.asarray(forced)])
        flat = self._upload_rows(np.concatenate(host).astype(np.int64))                      # SK + S + S + 1 (+ S)
        index, at = flat[:s * width].view(s, width), s * width
        rows = VerifyRows(torch.where(index >= 0, input_ids[index.clamp(min=0)], -1), flat[at:at + s],
                          flat[at + s:at + 2 * s + 1], width)
        forced_accepts = None if forced is None else flat[at + 2 * s + 1:]
        # grammar masks: filled on the host while the forward runs (after the committed tokens and the host's drafts)
        masks = grammar_row_masks(sampled, self.grammars, logits.shape[-1], self._upload_masks)
        if all(p.seq.params.argmax_only for p in sampled):   # no sampling state, no draws
            return sample(logits, rows, None, None, forced_accepts, token_masks=masks)
        uses_q = [not overlap and p.seq.draft_probs is not None and p.num_drafts > 0 and not p.seq.params.greedy
                  for p in sampled]
        sampling = SamplingBatch.of([p.seq for p in sampled], uses_q, logits.shape[-1], self._upload_sampling)
        if unread is not None and unread.sampled:   # + the unread step's tokens, which only the device knows
            sampling = dataclasses.replace(sampling, offsets=sampling.offsets + unread_emitted(
                sampled, unread, self._upload_sampling[1]))
        return sample(logits, rows, sampling, draft_probs_rows(sampled, uses_q, logits), forced_accepts,
                      token_masks=masks)
