"""The MTP drafter's KV block tables: one host row per sequence it holds, [rows, width] int32, so that a step's
tables are one fancy-indexing read (no per-block Python). With the verifier's prefix cache, its blocks outlive
their sequences the same way the target's do (specdec/prefix_cache.py): at a checkpoint the complete blocks are
registered under the verifier's hashes and the last one kept, and a sequence resumed there shares them (its copy
of the last one is queued by the caller)."""
from __future__ import annotations

import math

import numpy as np

from specdec.drafting import PrefixBlocks
from specdec.prefix_cache import BlockPool, Checkpoints


class SequenceTables:
    def __init__(self, blocks: BlockPool, block_size: int, width: int, num_checkpoints: int = 0):
        """`width` blocks per sequence at most (max_context / block_size); `num_checkpoints`: prefix checkpoints
        kept (each holds one block)."""
        self.blocks, self.block_size, self.width = blocks, block_size, width
        self.checkpoints = Checkpoints(blocks, num_checkpoints)
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
            self.checkpoints.reclaim(needed - have)   # (kept checkpoints give way to running sequences)
            self.array[row, have:needed] = self.blocks.take(needed - have)
            self.lens[row] = needed

    def resume(self, seq_id: int, prefix: PrefixBlocks) -> tuple[int, int] | None:
        """Hold a new sequence at the checkpoint it resumed from: its complete blocks shared, a block taken for the
        last one. Returns (the checkpoint's last block, the copy's block) to copy, or None if this drafter lacks them
        (then it holds nothing for the sequence)."""
        m = prefix.resumed
        if prefix.block_size != self.block_size or seq_id in self.row_of or not 0 < m <= self.width:
            return None
        shared = [self.blocks.lookup(h) for h in prefix.hashes[:m - 1]]
        entry = self.checkpoints.get(prefix.hashes[m - 1])
        if entry is None or None in shared or self.blocks.num_free < 1 + self.blocks.num_idle(shared):
            return None
        for block in shared:
            self.blocks.share(block)
        copy = self.blocks.take(1)[0]
        row = self.row_of[seq_id] = self._take_row()
        self.array[row, :m] = shared + [copy]
        self.lens[row] = m
        return entry[0], copy

    def checkpoint(self, seq_id: int, prefix: PrefixBlocks) -> None:
        """The sequence's call ended at a checkpoint (its KV below it written): keep it."""
        m, row = prefix.checkpoint, self.row_of.get(seq_id)
        if row is None or prefix.block_size != self.block_size or self.lens[row] < m:
            return
        blocks = self.array[row, :m].tolist()
        for block, h in zip(blocks[:m - 1], prefix.hashes[:m - 1]):
            self.blocks.register(block, h)
        self.checkpoints.add(prefix.hashes[m - 1], blocks[m - 1])

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
