"""The committed tokens' hidden rows for the drafter, gathered on the device before the step's one host sync.

Which rows the drafter gets depends on how many drafts each sequence accepted, which the host learns only at the
sync. Gathering after it costs an index upload and a gather on the critical path (host time while the GPU
idles). Here the same rows are placed from the device's accepted counts while
the GPU still runs the verify step; after the sync the rows are a view of this buffer.

Layout (R = the step's flat rows, B = its sequences, S = those sampled): sequence b's rows are first_row[b] ..
first_row[b] + len(chunk_b) - 1; it commits base[b] + accepted[b] of them (base: the chunk less its drafts; the
accepted count is 0 for a sequence not sampled). The committed rows go, in batch order, to
    out[offset[b] + p] = hidden[first_row[b] + p]   for p < base[b] + accepted[b],  offset = exclusive cumsum
and every other row to a row of its own past the end (out[R_max + r]), so no two rows write one place.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.models.pinned_upload import PinnedUpload


class HiddenStaging:
    def __init__(self, max_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.max_rows = max_rows
        self.buffer = torch.empty(2 * max_rows, hidden_size, dtype=dtype, device=device)  # [2 R_max, H]
        self._upload = PinnedUpload(device)
        self._layout: tuple[torch.Tensor, ...] | None = None
        self.staged = False   # this step's rows are in the buffer

    def layout(self, chunk_lens: list[int], num_drafts: list[int], sampled: list[int]) -> None:
        """Before the sync: the step's layout (per sequence: its chunk length and drafts; `sampled`: the batch
        positions of the sampled sequences, in the order of the verdict's accepted counts)."""
        lens = np.asarray(chunk_lens, np.int64)
        rows = int(lens.sum())
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows in a step, the staging buffer holds {self.max_rows}")
        seq_of_row = np.repeat(np.arange(len(lens)), lens)                              # [R]
        pos = np.arange(rows) - np.repeat(np.cumsum(lens) - lens, lens)                 # [R] place in its chunk
        base = lens - np.asarray(num_drafts, np.int64)                                  # [B]
        spare = self.max_rows + np.arange(rows)                                         # [R] rows not committed
        flat = self._upload(np.concatenate([seq_of_row, pos, spare, base, np.asarray(sampled, np.int64)]))
        b = len(lens)
        self._layout = (flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows], flat[3 * rows:3 * rows + b],
                        flat[3 * rows + b:])

    def gather(self, hidden: torch.Tensor, accepted: torch.Tensor | None) -> None:
        """hidden [R, H] of the step; accepted [S] accepted drafts of the sampled sequences (device), or None
        when nothing was accepted. Only queues device work: no sync."""
        seq_of_row, pos, spare, base, sampled = self._layout
        counts = base if accepted is None else base.index_add(0, sampled, accepted.to(base.dtype))   # [B]
        offset = torch.cumsum(counts, 0) - counts                                                     # [B]
        dest = torch.where(pos < counts[seq_of_row], offset[seq_of_row] + pos, spare)                 # [R]
        self.buffer.index_copy_(0, dest, hidden)   # the engine sizes the buffer in hidden's dtype
        self.staged = True

    def rows(self, count: int) -> torch.Tensor:
        """After the sync: the first `count` committed rows, [count, H] (a view, valid until the next step)."""
        return self.buffer[:count]
