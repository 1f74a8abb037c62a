"""The MTP drafter's warm-up: every Triton variant its steps can reach is compiled before it serves.

Its CUDA graphs (batch buckets, a prompt chunk alone) compile what they run while they are captured, but the
draft loop also runs eagerly: the front rows of prompt chunks beside decoding sequences (PromptRows, no draft
steps) and catch-ups that fit no bucket (several prompts at once, a synchronous step after a reconnect). Triton
compiles a new variant of a kernel for each new class of shape it meets there: paged attention's query tile
(from the longest chunk) and split count (from the number of sequences), the norms' rows per program, and every
integer argument that is 1, divisible by 16 or neither. On a fresh stack those compiles stalled the first bursts
at new batch sizes after SERVING (tests/test_gpu_warm_up.py counts them).

So the warm-up runs the eager loop over every number of sequences up to the largest graph bucket, each with
chunks of lengths that reach each class (1, 2, 3, 5, 9, 16, 17, 33, ...), with no draft steps and with k, in
steps of at most MAX_STEP_TOKENS rows (the verifier's largest step by default on a GPU). Kernels compile per
shape class, not per weight: a drafter waiting for the verifier's weights (CUDA IPC) warms up on stand-in
weights of the same shapes first (factory.py), so attaching the real ones only captures the graphs again.
The warm-up's sequences are released after; the KV rows they wrote are overwritten before any read."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from .draft_loop import MAX_STEP_TOKENS, pairs_plan
from .mtp_drafter import MTPDrafter

log = logging.getLogger(__name__)
CHUNK_LENGTHS = (1, 2, 3, 5, 9, 16, 17, 33, 64, 65, 129, 256, 257, 513, 1024, 2048)
FIRST_SEQ_ID = 1 << 62   # above any id a verifier gives (it counts from 0)


@dataclass(frozen=True)
class WarmUpReport:
    num_runs: int
    max_seqs: int
    max_tokens: int
    seconds: float


def warm_up(drafter: MTPDrafter, max_tokens: int = MAX_STEP_TOKENS) -> WarmUpReport:
    """Run the draft loop eagerly (or replay its graphs where one fits) over the shapes above."""
    start, loop = time.perf_counter(), drafter.loop
    max_seqs = loop.max_seqs
    hidden = torch.zeros(max_tokens, loop.hidden_in.shape[1], dtype=loop.hidden_in.dtype,
                         device=drafter.device)                                        # [max_tokens, H]
    longest = drafter.tables.width * drafter.block_size - drafter.max_drafts   # positions a sequence may take
    shapes = [(b, n) for b in range(1, max_seqs + 1) for n in CHUNK_LENGTHS if b * n <= max_tokens and n <= longest]
    num_runs = 0
    for num_seqs, length in tqdm(shapes, desc="mtp drafter warm-up", unit="shape", leave=False):
        ids = list(range(FIRST_SEQ_ID, FIRST_SEQ_ID + num_seqs))
        try:
            for seq_id in ids:
                drafter.tables.reserve(seq_id, length + drafter.max_drafts)
            tables, table_lens = drafter.tables.rows(ids)
            plan = pairs_plan(np.zeros(num_seqs * length, np.int64), np.full(num_seqs, length, np.int64),
                              np.zeros(num_seqs, np.int64), tables, table_lens)
            for num_steps in (0, drafter.max_drafts):
                loop.run(plan, hidden[: plan.num_tokens], num_steps)
                num_runs += 1
        finally:
            drafter.release(ids)
    if drafter.device.type == "cuda":
        torch.cuda.synchronize(drafter.device)
    return WarmUpReport(num_runs, max_seqs, max_tokens, time.perf_counter() - start)
