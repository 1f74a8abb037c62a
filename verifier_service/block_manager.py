"""Which sequence holds which part of the target's caches: KV blocks of `block_size` positions, and one GDN /
conv state slot per running sequence. The scheduler reserves and releases through it; the executor reads the
tables it keeps (block_rows: one host row per slot, updated as blocks are added, so a step's tables are one
fancy-indexing read) into each StepPlan, and has the model runner reset the state of slots newly taken
(`take_fresh_slots`) before the step that uses them."""
from __future__ import annotations

import math

import numpy as np

from specdec.id_pool import IdPool

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq
        self.kv_blocks = IdPool(num_blocks, "kv blocks")
        self.gdn_slots = IdPool(max_seqs, "gdn slots")
        self.block_rows = np.zeros((max_seqs + 1, max_blocks_per_seq), np.int32)   # [slot, W] (last: scratch)
        self._fresh: list[int] = []    # slots taken since the last step: their GDN / conv state must be reset

    @property
    def max_len(self) -> int:
        """The longest sequence a block table holds."""
        return self.max_blocks_per_seq * self.block_size

    def blocks_needed(self, seq: Sequence, length: int) -> int:
        return max(0, math.ceil(length / self.block_size) - len(seq.block_table))

    def fits(self, seq: Sequence, length: int) -> bool:
        """Enough free blocks for positions < length (its slot aside)."""
        return self.blocks_needed(seq, length) <= self.kv_blocks.num_free

    def can_admit(self, seq: Sequence, length: int) -> bool:
        return self.gdn_slots.num_free > 0 and self.fits(seq, length)

    def reserve(self, seq: Sequence, length: int) -> None:
        """Make sure `seq` has a GDN slot and KV blocks for positions < length."""
        if seq.gdn_slot < 0:
            slot = self.gdn_slots.take()[0]
            self._fresh.append(slot)
            seq.took_slot(slot)
        needed = self.blocks_needed(seq, length)
        if needed == 0:
            return
        have = len(seq.block_table)
        if have + needed > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq.seq_id} needs {length} tokens of cache, max_model_len is {self.max_len}")
        new = self.kv_blocks.take(needed)
        self.block_rows[seq.gdn_slot, have:have + needed] = new
        seq.took_blocks(new)

    def release(self, seq: Sequence) -> None:
        self.kv_blocks.give_back(seq.block_table)
        if seq.gdn_slot >= 0:
            self.gdn_slots.give_back([seq.gdn_slot])
            if seq.gdn_slot in self._fresh:   # taken and given back before any step used it
                self._fresh.remove(seq.gdn_slot)
        seq.caches_released()

    def take_fresh_slots(self) -> list[int]:
        """The slots taken since the last call (their state is reset before the step that uses them)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def tables(self, slots: np.ndarray, width: int | None = None) -> np.ndarray:
        """[B, width] int32 block tables of the sequences in these slots (width: the longest table among them;
        default all max_blocks_per_seq columns)."""
        return self.block_rows[slots, :width]
