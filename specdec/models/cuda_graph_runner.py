"""Decode / verify steps replayed from CUDA graphs, one per (batch-size bucket, tokens per sequence), and prompt
chunks of one sequence alone (prefill buckets: one sequence of up to q tokens, one logit row).

A step of B sequences with at most q tokens each runs in the graph of the smallest bucket >= B captured for
the smallest q' >= q: its batch is staged padded to that bucket (padding sequences of length 0 on the scratch
GDN slot, padding tokens writing the scratch KV row, logit rows padded with row 0), so every tensor the graph
reads sits at the address it was captured with. A prompt chunk alone (one sequence, no drafts, at most one
logit row: at batch 1 the chunks of every prompt longer than the largest q, up to 256 tokens each) runs in the
smallest prefill bucket that holds it; an eager
prefill is bound by launching ~900 kernels (24 ms for 128 tokens at the 4B shape on an H100, 7 ms of GPU work).
Larger batches and longer chunks, and prompt chunks beside other sequences, run eagerly.

The captured callable is `step(batch) -> tuple of tensors`; its outputs are static buffers, overwritten by the
next replay of any graph (they share one memory pool). Whatever the caller appends to `step` before capture
(e.g. sampling on the device) is captured with it. Without `capture` the same padded batches run eagerly:
the CPU tests check the padding that way, and it separates graph bugs from padding bugs on a GPU.
"""
from __future__ import annotations

import gc
import logging
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from .batch_staging import BatchStaging, StepPlan
from .forward_batch import ForwardBatch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (32, 64, 128, 256)   # prefill buckets: one sequence of up to this many tokens
Step = Callable[[ForwardBatch], tuple[torch.Tensor, ...]]


def buckets_for(max_seqs: int, candidates: tuple[int, ...] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The candidate buckets below max_seqs plus the first one that holds max_seqs (if any)."""
    below = tuple(b for b in candidates if b < max_seqs)
    above = [b for b in candidates if b >= max_seqs]
    return below + tuple(above[:1])


def graph_tokens(batch_buckets: tuple[int, ...], tokens_per_seq: tuple[int, ...],
                 prefill_tokens: tuple[int, ...] = ()) -> int:
    """Tokens of the largest bucket: what the graphs' staging area must hold."""
    return max(max(batch_buckets) * max(tokens_per_seq), max(prefill_tokens, default=0))


class CudaGraphRunner:
    def __init__(self, step: Step, staging: BatchStaging, batch_buckets: tuple[int, ...],
                 tokens_per_seq: tuple[int, ...], capture: bool = True, prefill_tokens: tuple[int, ...] = ()):
        self.step, self.staging, self.capture = step, staging, capture
        self.batch_buckets, self.tokens_per_seq = tuple(sorted(batch_buckets)), tuple(sorted(tokens_per_seq))
        self.prefill_tokens = tuple(q for q in sorted(prefill_tokens) if q > self.tokens_per_seq[-1])
        if self.batch_buckets[-1] > staging.max_seqs or \
                graph_tokens(self.batch_buckets, self.tokens_per_seq, self.prefill_tokens) > staging.max_tokens:
            raise ValueError(f"graph staging area ({staging.max_seqs} sequences, {staging.max_tokens} tokens) "
                             f"is smaller than the largest bucket")
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = None

    def bucket_for(self, plan: StepPlan) -> tuple[int, int] | None:
        """(batch bucket, tokens per sequence) for this step, or None when it must run eagerly."""
        if plan.num_seqs == 0:
            return None
        longest = int(plan.seq_lens.max())
        if plan.num_seqs <= self.batch_buckets[-1]:
            q = next((q for q in self.tokens_per_seq if q >= longest), None)
            if q is not None:
                return next(b for b in self.batch_buckets if b >= plan.num_seqs), q
        if plan.num_seqs == 1 and plan.logits_per_seq[0] <= 1 and plan.num_drafts[0] == 0:
            q = next((q for q in self.prefill_tokens if q >= longest), None)
            if q is not None:
                return 1, q
        return None

    def is_prefill(self, bucket: tuple[int, int]) -> bool:
        """Is this a prefill bucket (one sequence, one logit row, no drafts)?"""
        return bucket[1] in self.prefill_tokens

    def run(self, plan: StepPlan, bucket: tuple[int, int], before: Callable[[ForwardBatch], object] | None = None
            ) -> tuple[ForwardBatch, tuple[torch.Tensor, ...]]:
        """Stage the padded batch and replay its graph (or run it eagerly without capture). Returns the padded
        batch and the step's padded outputs; rows past the real tokens / logit rows are padding. `before` gets
        the staged batch first (device work queued ahead of the replay, e.g. writing input ids in place)."""
        batch = self.staging.stage(plan, bucket, prefill=self.is_prefill(bucket))
        if before is not None:
            before(batch)
        if not self.capture:
            return batch, self.step(batch)
        graph, outputs = self.graphs[bucket]
        graph.replay()
        return batch, outputs

    def capture_all(self) -> None:
        """Capture every bucket (they share one memory pool): the prefill buckets, then the batch buckets, each
        group largest first. Each is warmed up eagerly first (Triton compiles) on a batch of padding only, so no
        sequence's cache is touched."""
        if not self.capture:
            return
        self.pool = torch.cuda.graph_pool_handle()
        keys = [(1, q) for q in reversed(self.prefill_tokens)]
        keys += [(b, q) for q in reversed(self.tokens_per_seq) for b in reversed(self.batch_buckets)]
        for key in tqdm(keys, desc="capturing CUDA graphs", unit="graph", leave=False):
            try:
                self.graphs[key] = self._capture(key)
            except Exception as e:
                raise RuntimeError(f"capturing the CUDA graph of {key[0]} sequences x {key[1]} tokens failed "
                                   f"({type(e).__name__}: {e}); --enforce-eager runs without graphs") from e
        log.info("captured %d CUDA graphs: batch buckets %s x tokens per sequence %s, prefill buckets of one "
                 "sequence %s", len(self.graphs), self.batch_buckets, self.tokens_per_seq, self.prefill_tokens)

    def _capture(self, bucket: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        batch = self.staging.stage(padding_only_plan(self.staging.max_blocks), bucket,
                                   prefill=self.is_prefill(bucket))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()   # a collection inside the capture may free another runner's graph: that ends the capture
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.step(batch)
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize()
        return graph, tuple(outputs)


def padding_only_plan(width: int) -> StepPlan:
    """A step with no sequences: staged into a bucket it is all padding (scratch slot, scratch KV row)."""
    empty64, empty32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
    return StepPlan(token_ids=empty64, seq_lens=empty64, start_positions=empty64,
                    block_tables=np.zeros((0, width), np.int32), table_lens=empty64, gdn_slots=empty32,
                    gdn_read_offsets=empty32, num_drafts=empty32, logits_per_seq=empty64)
