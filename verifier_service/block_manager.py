"""Which sequence holds which part of the target's caches: KV blocks of `block_size` positions, one GDN / conv
state slot per running sequence, and with prefix caching the checkpoints that outlive their sequences
(specdec/prefix_cache.py: full blocks by their chained hash, each checkpoint's last block and GDN / conv state in
a row of its own). The scheduler reserves, resumes and releases through it; the executor registers checkpoints
at launch and reads the tables it keeps (block_rows: one host row per slot, updated as blocks are added, so a
step's tables are one fancy-indexing read) into each StepPlan, and has the model runner apply the step's
`CacheOps` (states reset or restored, blocks copied before the forward, states saved after it).

A drafter that keeps its own part of each checkpoint (one that takes hidden states: the MTP head's KV) sees only
the sequences in it: a checkpoint saved by a sequence out of the drafter is "target-only", and a sequence in such a
drafter does not resume from it (the drafter would report the context missing and the sequence would prefill
again from position 0); it computes that prefix once more, and its checkpoint there is then the drafter's too. A
drafter of tokens is sent a resumed sequence's tokens whole, so it resumes anywhere."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from specdec.id_pool import IdPool
from specdec.prefix_cache import BlockPool, Checkpoints, PrefixStats, chain_hashes, next_checkpoint, root_hash

from .sequence import Sequence

HASH_BATCH = 64   # blocks hashed at a time while matching a prompt's cached prefix


@dataclass(frozen=True)
class PrefixCaching:
    """Prefix caching's settings (`--no-prefix-caching`, `--prefix-checkpoint-interval`, `--prefix-checkpoints`)."""
    enabled: bool = True
    checkpoint_interval: int = 1024      # tokens between two checkpoints of a prompt (and one at its end)
    num_checkpoints: int = 16            # GDN state rows kept for checkpoints (0 here: none, so off; the CLI's
    #                                      --prefix-checkpoints 0 means its default, 2 x --max-running)


@dataclass
class CacheOps:
    """A step's cache work besides the forward: GDN / conv rows to zero and (src, dst) row copies before it, KV
    block (src, dst) copies before it, and (slot, row) state saves after it."""
    fresh_slots: list[int] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix a sequence can resume from: its first `num_blocks` blocks' checkpoint."""
    num_blocks: int
    shared: list[int]            # blocks 0 .. num_blocks - 2, shared as they are
    last_block: int              # block num_blocks - 1 (copied: its last position is the sequence's to write)
    row: int                     # the checkpoint's GDN / conv state

    def num_cached(self, block_size: int) -> int:
        return self.num_blocks * block_size - 1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int,
                 prefix: PrefixCaching = PrefixCaching(enabled=False)):
        self.block_size, self.max_blocks_per_seq = block_size, max_blocks_per_seq
        self.prefix = prefix if prefix.enabled and prefix.num_checkpoints > 0 else PrefixCaching(enabled=False)
        interval = self.prefix.checkpoint_interval
        if self.prefix.enabled and (interval < block_size or interval % block_size):
            raise ValueError(f"the prefix checkpoint interval ({interval}) must be a positive multiple of the KV "
                             f"block size ({block_size})")
        self.kv_blocks = BlockPool(num_blocks, "kv blocks")
        self.gdn_slots = IdPool(max_seqs, "gdn slots")
        self.checkpoints = Checkpoints(self.kv_blocks, self.prefix.num_checkpoints if self.prefix.enabled else 0,
                                       first_row=max_seqs)
        self.stats = PrefixStats()
        self._target_only: set[int] = set()   # checkpoint hashes saved by sequences out of the drafter only
        self.drafter_keeps_prefixes = False    # the drafter keeps its own part of checkpoints (set by the engine)
        self.paused = False      # no lookups, no checkpoints (the warm-up: its made-up prompts share prefixes)
        self.block_rows = np.zeros((max_seqs + 1, max_blocks_per_seq), np.int32)   # [slot, W] (last: scratch)
        self._ops = CacheOps()   # since the last step

    @property
    def max_len(self) -> int:
        """The longest sequence a block table holds."""
        return self.max_blocks_per_seq * self.block_size

    def blocks_needed(self, seq: Sequence, length: int) -> int:
        return max(0, math.ceil(length / self.block_size) - len(seq.block_table))

    def fits(self, seq: Sequence, length: int) -> bool:
        """Enough free blocks for positions < length (its slot aside), checkpoints dropped for them if need be."""
        needed = self.blocks_needed(seq, length)
        self.checkpoints.reclaim(needed)
        return needed <= self.kv_blocks.num_free

    def can_admit(self, seq: Sequence, length: int, hit: PrefixHit | None = None) -> bool:
        """A slot and blocks for positions < length, resuming from `hit` if given (its shared blocks need none,
        but those idle now stop being free)."""
        if self.gdn_slots.num_free == 0:
            return False
        if hit is None:
            return self.fits(seq, length)
        needed = math.ceil(length / self.block_size) - len(hit.shared) + self.kv_blocks.num_idle(hit.shared)
        return needed <= self.kv_blocks.num_free   # (its checkpoint's block must stay: none is dropped here)

    # ---- prefix caching ------------------------------------------------------------------------
    def next_checkpoint(self, seq: Sequence, start: int) -> int | None:
        """Where the chunk of `seq` from position `start` must end so that its state is kept (None: nowhere)."""
        if not self.prefix.enabled or self.paused:
            return None
        return next_checkpoint(start, len(seq.token_ids), self.block_size, self.prefix.checkpoint_interval)

    def _hash(self, seq: Sequence, num_blocks: int) -> list[int]:
        """`seq`'s block hashes, extended to (at least) its first `num_blocks` blocks, from its cache salt's root."""
        if len(seq.block_hashes) < num_blocks:
            seq.hashed(chain_hashes(seq.token_ids, self.block_size, num_blocks, seq.block_hashes,
                                    root_hash(seq.params.cache_salt)))
        return seq.block_hashes

    def match(self, seq: Sequence) -> PrefixHit | None:
        """The longest cached prefix of `seq`'s tokens it can resume from (it must still run >= 1 token)."""
        if not self.prefix.enabled or self.paused or not len(self.checkpoints):
            return None
        num_blocks = len(seq.token_ids) // self.block_size
        complete, hashes = self._matched(seq, num_blocks)
        for m in range(min(complete + 1, num_blocks), 0, -1):   # blocks 0 .. m - 2 complete, m - 1 the checkpoint's
            if seq.in_drafter and self.drafter_keeps_prefixes and hashes[m - 1] in self._target_only:
                continue
            entry = self.checkpoints.get(hashes[m - 1])
            if entry is not None:
                shared = [self.kv_blocks.lookup(h) for h in hashes[:m - 1]]
                return PrefixHit(m, shared, *entry)
        return None

    def _matched(self, seq: Sequence, num_blocks: int) -> tuple[int, list[int]]:
        """How many of `seq`'s first `num_blocks` blocks are cached (from the first), and its block hashes, computed
        only as far as a match needs (the block after the last cached one, whose checkpoint may be kept): a new
        prompt is hashed further as its chunks reach checkpoints, while the device runs the chunks before."""
        complete, hashes = 0, seq.block_hashes
        while complete < num_blocks:
            upto = min(num_blocks, complete + HASH_BATCH)
            hashes = self._hash(seq, upto)
            found = self.kv_blocks.matched(hashes[complete:upto])
            complete += found
            if complete < upto:
                break
        return complete, hashes

    def queried(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """Count an admission's lookup (prompt tokens asked, and served)."""
        self.stats.queried_tokens += seq.num_prompt
        self.stats.hit_tokens += min(hit.num_cached(self.block_size), seq.num_prompt) if hit else 0

    def resume(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give `seq` (holding no caches) the hit's state: its shared blocks, a copy of its last block, a slot
        restored from its row."""
        for block in hit.shared:
            self.kv_blocks.share(block)
        copy = self.kv_blocks.take(1)[0]
        self._ops.block_copies.append((hit.last_block, copy))
        slot = self.gdn_slots.take()[0]
        self._ops.restores.append((hit.row, slot))
        seq.took_slot(slot)
        blocks = hit.shared + [copy]
        self.block_rows[slot, :len(blocks)] = blocks
        seq.took_blocks(blocks)
        seq.resumed(hit.num_cached(self.block_size), seq.block_hashes[hit.num_blocks - 1])

    def checkpoint(self, seq: Sequence, position: int) -> None:
        """`seq`'s launched chunk ends at checkpoint `position`: its complete blocks are registered and its state is
        saved (after the step) with the checkpoint's last block, unless that checkpoint is kept already."""
        m = (position + 1) // self.block_size
        self._hash(seq, m)
        for block, h in zip(seq.block_table[:m - 1], seq.block_hashes[:m - 1]):
            self.kv_blocks.register(block, h)
        key = seq.block_hashes[m - 1]
        row = self.checkpoints.add(key, seq.block_table[m - 1])
        if row is not None:
            self._ops.saves.append((seq.gdn_slot, row))
        if seq.in_drafter:
            self._target_only.discard(key)
        elif row is not None:
            if len(self._target_only) >= 2 * self.checkpoints.capacity:   # forget the dropped ones
                self._target_only = {h for h in self._target_only if h in self.checkpoints}
            self._target_only.add(key)

    def forget(self, checkpoint_hash: int) -> None:
        """Drop a checkpoint a drafter could not resume from: the next prompt that needs it computes it again (and
        the drafter keeps its own part then)."""
        self.checkpoints.drop(checkpoint_hash)

    # ---- reservation ---------------------------------------------------------------------------
    def reserve(self, seq: Sequence, length: int) -> None:
        """Make sure `seq` has a GDN slot and KV blocks for positions < length."""
        if seq.gdn_slot < 0:
            slot = self.gdn_slots.take()[0]
            self._ops.fresh_slots.append(slot)
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
            ops = self._ops   # taken and given back before any step used it
            if seq.gdn_slot in ops.fresh_slots:
                ops.fresh_slots.remove(seq.gdn_slot)
            ops.restores = [(src, dst) for src, dst in ops.restores if dst != seq.gdn_slot]
        seq.caches_released()

    def take_cache_ops(self) -> CacheOps:
        """The cache work since the last call (the model runner applies it around the step that follows)."""
        ops, self._ops = self._ops, CacheOps()
        return ops

    def tables(self, slots: np.ndarray, width: int | None = None) -> np.ndarray:
        """[B, width] int32 block tables of the sequences in these slots (width: the longest table among them;
        default all max_blocks_per_seq columns)."""
        return self.block_rows[slots, :width]
