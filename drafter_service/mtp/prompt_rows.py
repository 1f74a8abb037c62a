"""The front rows of a step's long chunks (prompt chunks), ingested into the MTP KV cache ahead of the step's
catch-up, so that the catch-up keeps each chunk's last row only and fits a batch bucket's CUDA graph beside the
decoding sequences (chained_catch_up.py, `skip`). Without it, a step that admits prompts beside decoding
sequences runs the whole draft loop eagerly, milliseconds of the drafter's host time that the verifier waits for
through the drafter service (bench/step_split.py, pass starts).

Row t of the ingest is row rows[t] of the target's batch, never the last of its sequence (that one stays with
the catch-up), so each pair is (the next row's token, this row's hidden state), as in the whole chunk's catch-up:
    input_ids[t]    = target.input_ids[rows[t] + 1]
    positions[t]    = target.positions[rows[t]]
    slot_mapping[t] from the drafter's block tables
Only the KV rows it writes are kept (no draft steps); the catch-up queued after it on the same stream reads them.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafting import DeviceDraftStep
from specdec.models.batch_staging import StepPlan, concat_ranges
from specdec.models.forward_batch import ForwardBatch
from specdec.models.pinned_upload import PinnedUpload

from .chained_catch_up import place_rows
from .draft_loop import pairs_plan


class PromptRows:
    """The first skip[b] rows of each sequence b of `step` with skip[b] > 0 (host [B]): their host plan, and as
    `before` for the draft loop the device-only parts of the staged batch."""

    def __init__(self, step: DeviceDraftStep, skip: np.ndarray, block_size: int, upload: PinnedUpload):
        self.step, self.block_size = step, block_size
        self.held = skip > 0                                                              # [B] host
        self.lens = skip[self.held]                                                       # [B'] host
        self.num_tokens = int(self.lens.sum())
        starts = (np.cumsum(step.chunk_lens) - step.chunk_lens)[self.held]
        self.rows = upload(concat_ranges(starts, self.lens))                              # [T'] device

    def plan(self, tables: np.ndarray, table_lens: np.ndarray) -> StepPlan:
        return pairs_plan(np.zeros(self.num_tokens, np.int64), self.lens, self.step.start_pos[self.held], tables,
                          table_lens)

    def hidden(self) -> torch.Tensor:
        """[T', H] the target's hidden rows of these rows."""
        return self.step.hidden[self.rows]

    def __call__(self, batch: ForwardBatch) -> None:
        place_rows(batch, self.step, self.rows, self.block_size)
