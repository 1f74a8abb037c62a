"""What rank 0 tells the other tensor-parallel ranks about each step, and its wire form: one int64 tensor of a fixed
size, one gloo broadcast per step (broadcast_object_list pickles and broadcasts twice, size then bytes: it costs
more, bench/README.md, "Tensor parallelism"). A step larger than the tensor sends its words in a second broadcast.

    header: kind (0: stop, 1: step), share_inputs, B, T, W, F, R, C, S, replays_on_device, size (words after it)
    token_ids [T] · seq_lens, start_positions [B] · block_tables [B, W] · table_lens, gdn_slots, gdn_read_offsets,
    num_drafts, logits_per_seq [B] · the step's cache ops: fresh slots [F], restores [R, 2], block copies [C, 2],
    saves [S, 2]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from specdec.models.batch_staging import StepPlan

from .block_manager import CacheOps

HEADER = 11
STOP, STEP = 0, 1
PER_SEQ = ("seq_lens", "start_positions", "table_lens", "gdn_slots", "gdn_read_offsets", "num_drafts",
           "logits_per_seq")


@dataclass
class StepMessage:
    """One step for every rank: its plan, the cache work around it, whether rank 0's staged inputs follow on
    the device (ModelRunner.run's share_inputs). plan None: stop."""
    plan: StepPlan | None
    ops: CacheOps
    share_inputs: bool

    def pack(self) -> np.ndarray:
        if self.plan is None:
            return np.zeros(HEADER, np.int64)
        p = self.plan
        tables = p.block_tables[:, :int(p.table_lens.max(initial=0))]   # the columns any sequence fills
        parts = [p.token_ids, p.seq_lens, p.start_positions, tables.ravel(),
                 *(getattr(p, name) for name in PER_SEQ[2:]), np.asarray(self.ops.fresh_slots, np.int64)]
        pairs = (self.ops.restores, self.ops.block_copies, self.ops.saves)
        parts += [np.asarray(x, np.int64).reshape(-1) for x in pairs]
        body = np.concatenate([np.asarray(a, np.int64) for a in parts])
        head = [STEP, int(self.share_inputs), p.num_seqs, p.num_tokens, tables.shape[1],
                len(self.ops.fresh_slots), *map(len, pairs), p.replays_on_device, body.shape[0]]
        return np.concatenate([np.array(head, np.int64), body])

    @staticmethod
    def unpack(words: np.ndarray) -> "StepMessage":
        kind, share, b, t, w, f, num_restores, num_copies, num_saves, replays_on_device, _ = \
            (int(x) for x in words[:HEADER])
        if kind == STOP:
            return StepMessage(None, CacheOps(), False)
        at = HEADER

        def take(n: int, dtype=np.int64) -> np.ndarray:
            nonlocal at
            at += n
            return words[at - n:at].astype(dtype)
        token_ids, seq_lens, start_positions = take(t), take(b), take(b)
        tables = take(b * w, np.int32).reshape(b, w)
        table_lens, slots, offsets, drafts, logits = take(b), take(b, np.int32), take(b, np.int32), \
            take(b, np.int32), take(b)
        plan = StepPlan(token_ids=token_ids, seq_lens=seq_lens, start_positions=start_positions,
                        block_tables=tables, table_lens=table_lens, gdn_slots=slots, gdn_read_offsets=offsets,
                        num_drafts=drafts, logits_per_seq=logits, replays_on_device=replays_on_device)
        fresh = take(f).tolist()
        restores, copies, saves = (list(map(tuple, take(2 * x).reshape(x, 2).tolist()))
                                   for x in (num_restores, num_copies, num_saves))
        return StepMessage(plan, CacheOps(fresh, restores, copies, saves), bool(share))


class MessageChannel:
    """Rank 0 → every rank over a gloo group: a fixed buffer of `words` int64 (a larger step adds a broadcast)."""

    def __init__(self, group, words: int):
        self.group, self.buffer = group, torch.zeros(HEADER + words, dtype=torch.int64)

    def send(self, message: StepMessage) -> None:
        words = torch.from_numpy(message.pack())
        n = min(words.shape[0], self.buffer.shape[0])
        self.buffer[:n] = words[:n]
        dist.broadcast(self.buffer, src=0, group=self.group)
        if words.shape[0] > n:
            dist.broadcast(words[HEADER:], src=0, group=self.group)

    def receive(self) -> StepMessage:
        dist.broadcast(self.buffer, src=0, group=self.group)
        size = HEADER + int(self.buffer[HEADER - 1])
        if size <= self.buffer.shape[0]:
            return StepMessage.unpack(self.buffer[:size].numpy())
        body = torch.empty(size - HEADER, dtype=torch.int64)
        dist.broadcast(body, src=0, group=self.group)
        return StepMessage.unpack(np.concatenate([self.buffer[:HEADER].numpy(), body.numpy()]))
