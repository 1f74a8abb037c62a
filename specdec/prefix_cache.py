"""Prefix caching's shared parts: the chained hash that names a block of tokens by everything before it, where a
sequence's checkpoints fall, and a pool of KV blocks whose full blocks outlive their sequences (reference-counted
while shared, evicted least recently used when the pool needs them). The verifier keeps its target's KV blocks in
one, the MTP drafter its own.

A checkpoint is a cache state at position c = m * block_size - 1 of committed tokens (m >= 1): the KV of
positions < c and the recurrent (GDN / conv) state after tokens 0 .. c - 1. It depends only on tokens 0 .. c - 1,
so it is named by h_{m-1}, the hash of the blocks 0 .. m - 1 (tokens 0 .. m * block_size - 1). A sequence whose
first m blocks hash alike resumes there: it shares blocks 0 .. m - 2, copies block m - 1 (whose last position it
writes itself) and computes from token c on, so a prompt that is all cached still runs its last token. Since
every state a checkpoint keeps covers committed tokens only, a draft never reaches one.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .id_pool import PoolExhausted

ROOT_HASH = 0   # the parent of block 0 (without a cache salt)


def root_hash(cache_salt: str | None) -> int:
    """The parent of block 0 for a request's cache salt: requests share cached prefixes only under the same one."""
    if not cache_salt:
        return ROOT_HASH
    digest = hashlib.blake2b(b"cache_salt\0" + cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int, known: list[int] | None = None,
                 root: int = ROOT_HASH) -> list[int]:
    """Hashes of (at least) the first `num_blocks` blocks: h_j = H(h_{j-1}, tokens[j B : (j + 1) B]) (63-bit ints,
    so they fit any int64 field), h_{-1} = `root` (`root_hash` of the request's cache salt). `known`: hashes already
    computed for the first blocks (kept, and extended)."""
    hashes = list(known or [])
    parent = hashes[-1] if hashes else root
    first = len(hashes)
    if first >= num_blocks:
        return hashes
    # the tokens as int64 bytes in one conversion; each block then hashes a slice of them (the same bytes as
    # block-by-block conversion: a block past the tokens' end hashes what is left, maybe nothing)
    data = np.asarray(token_ids[first * block_size:num_blocks * block_size], np.int64).tobytes()
    width, blake2b = block_size * 8, hashlib.blake2b
    for offset in range(0, (num_blocks - first) * width, width):
        digest = blake2b(parent.to_bytes(8, "little") + data[offset:offset + width], digest_size=8).digest()
        parent = int.from_bytes(digest, "little") >> 1
        hashes.append(parent)
    return hashes


def next_checkpoint(start: int, num_tokens: int, block_size: int, interval: int) -> int | None:
    """The first checkpoint position after `start` of a sequence of `num_tokens` committed tokens, or None: one
    every `interval` tokens (a multiple of block_size) and one at the end (the last whole block, so a repeat of
    the same tokens resumes one token short of the end)."""
    last = (num_tokens // block_size) * block_size - 1          # the end's (>= 1 token after it)
    if last <= start:
        return None
    every = ((start + 1) // interval + 1) * interval - 1       # the next multiple of interval, less one
    return min(every, last)


@dataclass
class PrefixStats:
    """What admissions asked of the prefix cache, in prompt tokens (vLLM's queries / hits)."""
    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockPool:
    """KV block ids with reference counts. A block given back by its last owner is free; one registered under a
    hash is kept, idle, until a take needs it (least recently used first), and can be shared again meanwhile."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._free = list(range(size - 1, -1, -1))   # unregistered, unowned: pop() hands out low ids first
        self._refs = np.zeros(size, np.int32)
        self._idle: OrderedDict[int, None] = OrderedDict()   # registered, unowned: least recently used first
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks a take can have (idle registered ones included)."""
        return len(self._free) + len(self._idle)

    @property
    def num_registered(self) -> int:
        """Blocks registered under a hash (owned or idle)."""
        return len(self._block_of)

    def take(self, n: int = 1) -> list[int]:
        if n > self.num_free:
            raise PoolExhausted(f"{self.name}: asked for {n}, {self.num_free} free of {self.size}")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:   # evict the least recently used idle block: its hash is forgotten
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            out.append(block)
        return out

    def give_back(self, ids: list[int]) -> None:
        for block in reversed(ids):
            assert self._refs[block] > 0, f"{self.name}: block {block} given back more often than taken"
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def share(self, block: int) -> None:
        """One more owner of a block (an owned one, or a registered idle one)."""
        assert self._refs[block] > 0 or block in self._idle, f"{self.name}: block {block} is free"
        self._idle.pop(block, None)
        self._refs[block] += 1

    def register(self, block: int, block_hash: int) -> None:
        """`block` (owned) holds the content `block_hash` names, final from now on. A hash already held by another
        block keeps that one (this block stays unregistered)."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash], self._hash_of[block] = block, block_hash

    def lookup(self, block_hash: int) -> int | None:
        return self._block_of.get(block_hash)

    def matched(self, hashes: list[int]) -> int:
        """How many of these blocks (from the first) are registered."""
        for j, h in enumerate(hashes):
            if h not in self._block_of:
                return j
        return len(hashes)

    def num_idle(self, blocks: list[int]) -> int:
        """How many of these blocks are idle (sharing them takes them out of num_free)."""
        return sum(b in self._idle for b in blocks)

    def refs(self, block: int) -> int:
        return int(self._refs[block])


class Checkpoints:
    """Checkpoints by hash, at most `capacity` (least recently used dropped): each keeps its last block (written
    but for its last position; a reference on it in `pool`) and a row of its own, first_row .. first_row +
    capacity - 1, where the verifier keeps the checkpoint's GDN / conv state (the MTP drafter keeps none)."""

    def __init__(self, pool: BlockPool, capacity: int, first_row: int = 0):
        self.pool, self.capacity = pool, capacity
        self._entries: OrderedDict[int, tuple[int, int]] = OrderedDict()   # hash -> (block, row)
        self._rows = list(range(first_row + capacity - 1, first_row - 1, -1))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: int) -> tuple[int, int] | None:
        """(block, row) of a checkpoint, now the most recently used; None if there is none."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
        return entry

    def drop(self, block_hash: int | None = None) -> bool:
        """Drop a checkpoint (default: the least recently used), its block given back; False if there was none."""
        if block_hash is None and self._entries:
            block_hash = next(iter(self._entries))
        entry = self._entries.pop(block_hash, None) if block_hash is not None else None
        if entry is None:
            return False
        self.pool.give_back([entry[0]])
        self._rows.append(entry[1])
        return True

    def reclaim(self, num_blocks: int) -> None:
        """Drop checkpoints, least recently used first, until the pool has `num_blocks` free (or none is left)."""
        while self.pool.num_free < num_blocks and self.drop():
            pass

    def add(self, block_hash: int, block: int) -> int | None:
        """Keep `block` for `block_hash`; returns the row its state goes to (None: already kept, now the most recently
        used, so that two sides keeping the same checkpoints drop them in the same order; or no room)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return None
        if self.capacity <= 0:
            return None
        if not self._rows:
            self.drop()
        self.pool.share(block)
        row = self._rows.pop()
        self._entries[block_hash] = (block, row)
        return row
