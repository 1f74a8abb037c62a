"""Builds device-resident ForwardBatches: persistent pinned host buffers (numpy views), vectorised over
sequences, and one non-blocking host-to-device copy per step into one persistent device buffer.

Layout of the buffer (int32 words; the int64 fields first so that they stay 8-byte aligned):
    input_ids, positions, slot_mapping, logits_indices, seq_of_token   [max_tokens] int64 each
    cu_seqlens [max_seqs + 1], gdn_slots, gdn_read_offsets, num_drafts [max_seqs]   int32
    chunk_lanes [CHUNK_LANES, 4]                                                    int32
    block_tables [B, W] packed (W: the step's widest table, not max_blocks)         int32 (last)
Fields sit at fixed offsets, so a batch padded to a bucket always has the same addresses: what a CUDA graph
captured. The block tables travel packed, so that a step copies words for the blocks its sequences hold, not for
the longest context the staging allows (262,144 positions are 16,384 words a sequence). A batch padded to a bucket
reads them from `graph_tables` [max_seqs, max_blocks] instead, a fixed tensor the packed words are copied into
on the device (one copy kernel); columns past W keep stale entries no kernel reads (a sequence reads the blocks
below its length only). Two host buffers alternate; before one is refilled, the copy that last read it is waited
for.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from .forward_batch import CHUNK_LANE_MIN_TOKENS, CHUNK_LANES, ForwardBatch, as_array
from .graph_bucket import Bucket

INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices", "seq_of_token")
INT32_FIELDS = ("cu_seqlens", "gdn_slots", "gdn_read_offsets", "num_drafts", "chunk_lanes", "block_tables")


@dataclass
class StepPlan:
    """One step described on the host, one entry per sequence (numpy, no per-token Python)."""
    token_ids: np.ndarray         # [T] int64
    seq_lens: np.ndarray          # [B] int64 tokens of each sequence in this step
    start_positions: np.ndarray   # [B] int64 position of each sequence's first token
    block_tables: np.ndarray      # [B, W] int32, rows padded
    table_lens: np.ndarray        # [B] int64 valid entries of each row
    gdn_slots: np.ndarray         # [B] int32
    gdn_read_offsets: np.ndarray  # [B] int32
    num_drafts: np.ndarray        # [B] int32
    logits_per_seq: np.ndarray    # [B] int64 trailing tokens whose logits are wanted
    replays_on_device: int = 0    # most accepted drafts the device adds to a read offset before the step runs

    def __post_init__(self):
        b = self.seq_lens.shape[0]
        for name in ("start_positions", "table_lens", "gdn_slots", "gdn_read_offsets", "num_drafts",
                     "logits_per_seq"):
            as_array(getattr(self, name), name, b)
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != b:
            raise ValueError(f"block_tables: expected [{b}, W], got shape {self.block_tables.shape}")
        if self.token_ids.shape[0] != self.seq_lens.sum():
            raise ValueError(f"token_ids: {self.token_ids.shape[0]} tokens, seq_lens sum to {self.seq_lens.sum()}")
        self._check("logits", self.logits_per_seq, (self.logits_per_seq < 0) | (self.logits_per_seq > self.seq_lens))
        self._check("num_drafts", self.num_drafts,
                    (self.num_drafts < 0) | ((self.seq_lens > 0) & (self.num_drafts >= self.seq_lens)))

    def _check(self, name: str, values: np.ndarray, bad: np.ndarray) -> None:
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"{name}[{b}] = {values[b]} does not fit a sequence of {self.seq_lens[b]} tokens")

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def may_replay(self) -> bool:
        """May a sequence replay accepted drafts into its GDN state in this step?"""
        return self.replays_on_device > 0 or bool(self.gdn_read_offsets.any())

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @staticmethod
    def from_lists(token_chunks, start_positions, block_tables, gdn_slots, gdn_read_offsets=None, num_drafts=None,
                   logits: str | list[int] = "last") -> "StepPlan":
        b = len(token_chunks)
        lens = np.fromiter(map(len, token_chunks), np.int64, count=b)
        table_lens = np.fromiter(map(len, block_tables), np.int64, count=len(block_tables))
        if table_lens.shape[0] != b:
            raise ValueError(f"block_tables: expected {b} rows (one per sequence), got {table_lens.shape[0]}")
        tables = np.zeros((b, int(table_lens.max(initial=0))), np.int32)
        rows = np.repeat(np.arange(b), table_lens)
        cols = np.arange(rows.shape[0]) - np.repeat(np.cumsum(table_lens) - table_lens, table_lens)
        tables[rows, cols] = np.fromiter(chain.from_iterable(block_tables), np.int64, count=rows.shape[0])
        zeros = np.zeros(b, np.int32)
        return StepPlan(
            token_ids=np.fromiter(chain.from_iterable(token_chunks), np.int64, count=int(lens.sum())),
            seq_lens=lens, start_positions=as_array(start_positions, "start_positions", b), block_tables=tables,
            table_lens=table_lens, gdn_slots=as_array(gdn_slots, "gdn_slots", b, np.int32),
            gdn_read_offsets=zeros if gdn_read_offsets is None else as_array(gdn_read_offsets, "gdn_read_offsets",
                                                                             b, np.int32),
            num_drafts=zeros if num_drafts is None else as_array(num_drafts, "num_drafts", b, np.int32),
            logits_per_seq=logit_rows_per_seq(logits, lens))


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[Σ counts] int64: starts[0] .. starts[0] + counts[0] - 1, then the same for each segment in turn (the
    flat rows of chosen sequences in a ragged batch), with no per-row Python."""
    starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
    before = np.cumsum(counts) - counts                                       # [S] output offset of each segment
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()))


def logit_rows_per_seq(logits: str | list[int], seq_lens: np.ndarray) -> np.ndarray:
    """"last": one row per non-empty sequence, "all": every token, else the given count per sequence."""
    if isinstance(logits, str):
        if logits not in ("last", "all"):
            raise ValueError(f'logits: expected "last", "all" or one count per sequence, got {logits!r}')
        return (seq_lens > 0).astype(np.int64) if logits == "last" else seq_lens
    return as_array(logits, "logits", seq_lens.shape[0])


class BatchStaging:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", scratch_block: int = 0, scratch_gdn_slot: int = 0):
        """Capacities bound every batch it stages (padding included). Padding tokens write KV row
        `scratch_block * block_size`, padding sequences use `scratch_gdn_slot`: both must be cache rows
        no sequence owns when batches are padded."""
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size, self.device = block_size, torch.device(device)
        self.scratch_block, self.scratch_gdn_slot = scratch_block, scratch_gdn_slot
        sizes = {name: 2 * max_tokens for name in INT64_FIELDS}
        sizes |= {"cu_seqlens": max_seqs + 1, "gdn_slots": max_seqs, "gdn_read_offsets": max_seqs,
                  "num_drafts": max_seqs, "chunk_lanes": 4 * CHUNK_LANES, "block_tables": max_seqs * max_blocks}
        self.offsets, total = {}, 0
        for name in INT64_FIELDS + INT32_FIELDS:
            self.offsets[name], total = total, total + sizes[name]
        self.sizes = sizes
        pin = self.device.type == "cuda"
        self.host = [torch.zeros(total, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.host_views = [self._views(h.numpy(), lambda a: a.view(np.int64)) for h in self.host]
        self.copied = [None, None]   # CUDA event after the copy that last read each host buffer
        self.turn = 0
        self.buffer = torch.zeros(total, dtype=torch.int32, device=self.device)
        self.device_views = self._views(self.buffer, lambda t: t.view(torch.int64))
        self.graph_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=self.device)

    def _views(self, flat, as_int64) -> dict:
        views = {}
        for name, offset in self.offsets.items():
            part = flat[offset: offset + self.sizes[name]]
            views[name] = as_int64(part) if name in INT64_FIELDS else part
        return views

    def stage(self, plan: StepPlan, bucket: Bucket | None = None) -> ForwardBatch:
        """Fill a host buffer, copy it to the device (non-blocking) and return the batch as device views.
        `bucket`: pad to its sequences (length 0, scratch GDN slot), tokens (scratch KV row) and logit rows (row
        0), with its max_seqlen and max drafts: the static shape of a CUDA-graph bucket."""
        b, t = plan.num_seqs, plan.num_tokens
        n = int(plan.logits_per_seq.sum())
        bp, tp, np_ = (b, t, n) if bucket is None else (bucket.seqs, bucket.tokens, bucket.logit_rows)
        most_replays = int(plan.gdn_read_offsets.max(initial=0)) + plan.replays_on_device
        if bucket is not None and not bucket.holds(b, t, int(plan.seq_lens.max(initial=0)), n,
                                                   int(plan.num_drafts.max(initial=0)), most_replays,
                                                   int(plan.start_positions.min()) if b else None):
            raise ValueError(f"a step of {b} sequences, {t} tokens, {n} logit rows, {most_replays} replays "
                             f"does not fit {bucket}")
        self._check_capacity(plan, bp, tp, np_)
        h = self._next_host()
        cu = h["cu_seqlens"][: bp + 1]
        cu[0] = 0
        np.cumsum(plan.seq_lens, out=cu[1: b + 1])
        cu[b + 1:] = t
        seq_of_token = np.repeat(np.arange(b), plan.seq_lens)                                  # [T]
        positions = np.arange(t) - cu[seq_of_token] + plan.start_positions[seq_of_token]       # [T]
        self._check_blocks(plan, positions, seq_of_token)
        h["input_ids"][:t], h["input_ids"][t:tp] = plan.token_ids, 0
        h["positions"][:t], h["positions"][t:tp] = positions, 0
        h["seq_of_token"][:t], h["seq_of_token"][t:tp] = seq_of_token, 0
        blocks = plan.block_tables[seq_of_token, positions // self.block_size]
        h["slot_mapping"][:t] = blocks.astype(np.int64) * self.block_size + positions % self.block_size
        h["slot_mapping"][t:tp] = self.scratch_block * self.block_size
        wanted = plan.logits_per_seq
        first_row = np.repeat(cu[1: b + 1] - np.cumsum(wanted), wanted)
        h["logits_indices"][:n], h["logits_indices"][n:np_] = first_row + np.arange(n), 0
        width = max(1, plan.block_tables.shape[1])
        tables = h["block_tables"][: bp * width].reshape(bp, width)     # [bp, W] packed
        tables[:b, :plan.block_tables.shape[1]], tables[b:] = plan.block_tables, self.scratch_block
        for name, pad in (("gdn_slots", self.scratch_gdn_slot), ("gdn_read_offsets", 0), ("num_drafts", 0)):
            h[name][:b], h[name][b:bp] = getattr(plan, name), pad
        with_lanes = bucket is not None and bucket.seqs > 1 and bucket.max_seqlen > bucket.max_drafts + 1  # mixed
        if with_lanes:
            self._chunk_lanes(plan, cu, h["chunk_lanes"].reshape(CHUNK_LANES, 4))
        self._copy_to_device(self.offsets["block_tables"] + bp * width)
        d = self.device_views
        block_tables = d["block_tables"][: bp * width].view(bp, width)
        if bucket is not None:   # the graph's fixed tensor
            self.graph_tables[:bp, :width].copy_(block_tables)
            block_tables = self.graph_tables[:bp]
        max_seqlen = int(plan.seq_lens.max(initial=0)) if bucket is None else bucket.max_seqlen
        max_drafts = int(plan.num_drafts.max(initial=0)) if bucket is None else bucket.max_drafts
        return ForwardBatch(
            input_ids=d["input_ids"][:tp], positions=d["positions"][:tp], cu_seqlens=d["cu_seqlens"][: bp + 1],
            block_tables=block_tables, slot_mapping=d["slot_mapping"][:tp],
            gdn_slots=d["gdn_slots"][:bp], gdn_read_offsets=d["gdn_read_offsets"][:bp],
            num_drafts=d["num_drafts"][:bp], logits_indices=d["logits_indices"][:np_],
            num_seqs=bp, num_tokens=tp, max_seqlen=max_seqlen, max_num_drafts=max_drafts,
            max_replays=most_replays if bucket is None else bucket.max_replays,
            cu_seqlens_host=cu.copy() if bucket is None else None, seq_of_token=d["seq_of_token"][:tp],
            chunk_lanes=d["chunk_lanes"].view(CHUNK_LANES, 4) if with_lanes else None,
            min_context=0 if bucket is None else bucket.min_context)   # eager: the tiles the warm-ups compile

    def _chunk_lanes(self, plan: StepPlan, cu: np.ndarray, lanes: np.ndarray) -> None:
        """Fill `lanes` [CHUNK_LANES, 4] with the step's longest prompt chunks that may run chunked
        (forward_batch.py)."""
        eligible = ((plan.seq_lens >= CHUNK_LANE_MIN_TOKENS) & (plan.num_drafts == 0)
                    & (plan.gdn_read_offsets == 0))
        chosen = np.flatnonzero(eligible)
        chosen = chosen[np.argsort(-plan.seq_lens[chosen], kind="stable")][:CHUNK_LANES]
        num_lanes = chosen.shape[0]
        lanes[:num_lanes, 0], lanes[:num_lanes, 1], lanes[:num_lanes, 2], lanes[:num_lanes, 3] = \
            chosen, cu[chosen], cu[chosen + 1], plan.gdn_slots[chosen]
        lanes[num_lanes:] = (-1, 0, 0, self.scratch_gdn_slot)

    @property
    def step_inputs(self) -> torch.Tensor:
        """The device words of every field but the block tables (what a `before` hook may rewrite), one tensor."""
        return self.buffer[:self.offsets["block_tables"]]

    def _next_host(self) -> dict:
        self.turn ^= 1
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()   # the copy two steps ago: long done in a running loop
        return self.host_views[self.turn]

    def _copy_to_device(self, num_words: int) -> None:
        self.buffer[:num_words].copy_(self.host[self.turn][:num_words], non_blocking=True)
        if self.device.type == "cuda":
            event = self.copied[self.turn] or torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))   # the stream the copy was queued on
            self.copied[self.turn] = event

    def _check_capacity(self, plan: StepPlan, num_seqs: int, num_tokens: int, num_logits: int) -> None:
        for name, need, have in (("sequences", max(num_seqs, plan.num_seqs), self.max_seqs),
                                 ("tokens", max(num_tokens, plan.num_tokens), self.max_tokens),
                                 ("logit rows", num_logits, self.max_tokens),
                                 ("block table width", plan.block_tables.shape[1], self.max_blocks)):
            if need > have:
                raise ValueError(f"batch has {need} {name}, the staging area holds {have}")

    def _check_blocks(self, plan: StepPlan, positions: np.ndarray, seq_of_token: np.ndarray) -> None:
        if positions.shape[0] == 0:
            return
        short = positions // self.block_size >= plan.table_lens[seq_of_token]
        if short.any():
            i = int(np.argmax(short))
            b = int(seq_of_token[i])
            raise ValueError(f"block_tables[{b}] has {plan.table_lens[b]} blocks of {self.block_size}; "
                             f"position {positions[i]} needs more")
