"""The MTP catch-up of a step the verifier has not read yet, built from the target's batch on the device.

The catch-up pairs of a step are the target's own rows (specdec/drafting/device_drafting.py): row i of sequence b
at the target's position p pairs the token at p + 1 with the target's hidden state at p. So the catch-up batch
is the target's batch with its tokens shifted left by one inside each sequence, the last committed row taking
the sequence's next token, and the last committed row's output feeding the first draft step:

    input_ids[t]          = target.input_ids[t + 1]                  t < T - 1
    input_ids[last[b]]    = next_token[b]                            last[b] = cu[b] + committed[b] - 1
    positions[t]          = target.positions[t]                      (moved by the unread step's accepts)
    slot_mapping[t]       from the drafter's own block tables
    logits_indices[b]     = last[b]

Rows past last[b] carry rejected drafts: their KV rows sit past the sequence's committed end, where the first
draft step writes before it reads, so nothing reads them. The host stages everything else (cu_seqlens, block
tables, the positions before the move, which fit the blocks reserved for the largest move). Sequences the
drafter does not hold are left out: the catch-up then takes the other sequences' rows (`rows`, `seqs`).

A catch-up may also take part of each sequence's rows (`skip`: rows left out at its front, which an earlier
`PromptRows` ingest wrote into the KV cache on the same stream): a prompt chunk of n rows then brings only its
last row, so that it fits a batch bucket's k + 1 rows beside the decoding sequences. Its pair is the same, and
its attention reads the n - 1 rows before it from the cache, as the whole chunk's would.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafting import DeviceDraftStep
from specdec.models.batch_shift import place_slots
from specdec.models.batch_staging import StepPlan, concat_ranges
from specdec.models.forward_batch import ForwardBatch
from specdec.models.pinned_upload import PinnedUpload

from .draft_loop import pairs_plan


def place_rows(batch: ForwardBatch, step: DeviceDraftStep, rows: torch.Tensor, block_size: int) -> None:
    """The step's rows `rows` [T'] as the batch's pairs: each row's next token (the batch's last row keeps its
    own), its position, and its KV slot from the drafter's block tables."""
    t, ids = rows.shape[0], step.input_ids
    batch.input_ids[:t] = ids[(rows + 1).clamp_(max=ids.shape[0] - 1)]
    batch.positions[:t] = step.positions[rows]
    place_slots(batch, t, block_size)


class ChainedCatchUp:
    """The catch-up of `step` for the sequences `held` (a host mask), less `skip` rows at the front of each
    sequence (host, [B], zeros if None): its host plan, and as `before` for the draft loop the device-only parts
    of the staged batch."""

    def __init__(self, step: DeviceDraftStep, held: np.ndarray, block_size: int, upload: PinnedUpload,
                 skip: np.ndarray | None = None):
        self.step, self.block_size = step, block_size
        skip = np.zeros_like(step.chunk_lens) if skip is None else skip
        self.skip, self.lens = skip[held], (step.chunk_lens - skip)[held]          # [B'] host
        self.all_held = bool(held.all()) and not skip.any()
        self.num_seqs = int(held.sum())
        self.num_tokens = int(self.lens.sum())
        self.seqs = self.rows = self.skipped = None
        if not self.all_held:
            starts = (np.cumsum(step.chunk_lens) - step.chunk_lens)[held] + self.skip
            flat = upload(np.concatenate([np.flatnonzero(held), self.skip, concat_ranges(starts, self.lens)]))
            b = self.num_seqs
            self.seqs, self.skipped, self.rows = flat[:b], flat[b:2 * b], flat[2 * b:]       # [B'], [B'], [T']

    def plan(self, tables: np.ndarray, table_lens: np.ndarray, held: np.ndarray) -> StepPlan:
        """The host part: the held sequences' layout with the drafter's block tables (token ids written later)."""
        return pairs_plan(np.zeros(self.num_tokens, np.int64), self.lens, self.step.start_pos[held] + self.skip,
                          tables, table_lens)

    def hidden(self) -> torch.Tensor:
        """[T', H] the held sequences' hidden rows."""
        return self.step.hidden if self.all_held else self.step.hidden[self.rows]

    def __call__(self, batch: ForwardBatch) -> None:
        step, t, b = self.step, self.num_tokens, self.num_seqs
        ids, pos = step.input_ids, step.positions
        committed, next_token = step.committed, step.next_token
        if self.all_held:
            batch.input_ids[: t - 1] = ids[1:t]
            batch.positions[:t] = pos[:t]
            place_slots(batch, t, self.block_size)
        else:   # (the last row of each sequence takes its next token below)
            place_rows(batch, step, self.rows, self.block_size)
            committed, next_token = committed[self.seqs] - self.skipped, next_token[self.seqs]
        last = batch.cu_seqlens[:b].to(torch.int64) + committed - 1                       # [B']
        batch.input_ids.index_copy_(0, last, next_token)
        batch.logits_indices[:b] = last

    def scatter(self, drafts: torch.Tensor) -> torch.Tensor:
        """[B', K] drafts of the held sequences → [B, K] (rows of the others: zeros, never proposed)."""
        if self.all_held:
            return drafts
        out = drafts.new_zeros(len(self.step.seq_ids), drafts.shape[1])
        return out.index_copy_(0, self.seqs, drafts)
