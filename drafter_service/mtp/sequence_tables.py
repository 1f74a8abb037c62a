"""The MTP drafter's KV block tables: one host row per sequence it holds, [rows, width] int32, so that a step's
tables are one fancy-indexing read (no per-block Python)."""
from __future__ import annotations

import math

import numpy as np

from specdec.id_pool import IdPool


class SequenceTables:
    def __init__(self, blocks: IdPool, block_size: int, width: int):
        """`width` blocks per sequence at most (max_context / block_size)."""
        self.blocks, self.block_size, self.width = blocks, block_size, width
        self.array = np.zeros((8, width), np.int32)    # [rows, width]
        self.lens = np.zeros(8, np.int64)              # [rows] blocks held by each row
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(7, -1, -1))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.row_of

    def seq_ids(self) -> list[int]:
        return list(self.row_of)

    def reserve(self, seq_id: int, length: int) -> None:
        """Blocks for positions < length. Raises ValueError past `width` blocks, PoolExhausted without blocks."""
        needed = math.ceil(length / self.block_size)
        if needed > self.width:
            raise ValueError(f"{length} positions exceed max_context ({self.width * self.block_size})")
        row = self.row_of.get(seq_id)
        if row is None:
            row = self.row_of[seq_id] = self._take_row()
        have = int(self.lens[row])
        if needed > have:
            self.array[row, have:needed] = self.blocks.take(needed - have)
            self.lens[row] = needed

    def rows(self, seq_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tables [B, W] int32, blocks held [B] int64) of these sequences; W: the most blocks any of them holds
        (a step stages what its sequences use, not `width`)."""
        index = np.fromiter(map(self.row_of.__getitem__, seq_ids), np.int64, count=len(seq_ids))
        lens = self.lens[index]
        return self.array[index, :int(lens.max(initial=0))], lens

    def release(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.blocks.give_back(self.array[row, : self.lens[row]].tolist())
        self.lens[row] = 0
        self.free_rows.append(row)

    def _take_row(self) -> int:
        if not self.free_rows:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()
