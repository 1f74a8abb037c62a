"""Steps replayed from CUDA graphs, one per bucket (`graph_bucket.py`): decode / verify steps (batch-size bucket x
tokens per sequence), a prompt chunk of one sequence alone (prefill buckets: up to q tokens, one logit row), and
steps that mix prompt chunks with other sequences (mixed buckets: sequences x tokens in all, chunks up to the
largest prefill bucket those tokens hold: `mixed_seqlen`).

A step runs in the graph of the smallest bucket that holds it: its batch is staged padded to that bucket (padding
sequences of length 0 on the scratch GDN slot, padding tokens writing the scratch KV row, logit rows padded with row
0), so every tensor the graph reads sits at the address it was captured with. The kernels take their grids from the
bucket's host ints only and walk each sequence by its cu_seqlens on the device, so a sequence shorter than the
bucket's max_seqlen, or a padding one, costs programs that exit early. A decode or verify step takes a uniform
bucket (a single-token step where no sequence replays drafts: its no-replay graph, where there is one); a prompt
chunk alone (at batch 1 the chunks of every prompt longer than the largest q) the smallest prefill bucket (its deep
graph, of wider attention tiles, far enough into the prompt for the chunk's length:
`kernels.paged_attention.wide_tile_context`; the MTP drafter's runner keeps them too); a mixed step (new prompts
arriving beside decoding sequences) the smallest mixed bucket of at least its sequences and its tokens. An eager
step is bound by launching its ~900 kernels (several times its GPU work at the 4B shape). Steps past every bucket
(chunks longer than the largest prefill bucket, more tokens than the largest mixed bucket, more logit rows than
k + 1 per sequence) run eagerly.

The captured callable is `step(batch) -> tuple of tensors`; its outputs are static buffers, overwritten by the
next replay of any graph (they share one memory pool). Whatever the caller appends to `step` before capture
(e.g. sampling on the device) is captured with it. Without `capture` the same padded batches run eagerly:
the CPU tests check the padding that way, and it separates graph bugs from padding bugs on a GPU.
"""
from __future__ import annotations

import bisect
import gc
import logging
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from kernels.paged_attention import wide_tile_context

from .batch_staging import BatchStaging, StepPlan
from .forward_batch import ForwardBatch
from .graph_bucket import Bucket

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # prefill buckets: one sequence of up to this many
#                                       tokens (those past --max-batched-tokens' bucket are not captured)
MIXED_SEQS = (4, 16, 64)              # mixed buckets: sequences (padding ones cost an early exit per program)
MIXED_TOKENS = (256, 512, 576, 1024)  # mixed buckets: tokens in all (the GEMMs run on every one of them); 576:
#                                       a GPU's mixed prefill chunk (512) beside up to 64 decoding tokens
Step = Callable[[ForwardBatch], tuple[torch.Tensor, ...]]


def buckets_for(max_seqs: int, candidates: tuple[int, ...] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The candidate buckets below max_seqs plus the first one that holds max_seqs (if any)."""
    below = tuple(b for b in candidates if b < max_seqs)
    above = [b for b in candidates if b >= max_seqs]
    return below + tuple(above[:1])


def graph_tokens(batch_buckets: tuple[int, ...], tokens_per_seq: tuple[int, ...],
                 prefill_tokens: tuple[int, ...] = (), mixed_tokens: tuple[int, ...] = ()) -> int:
    """Tokens of the largest bucket: what the graphs' staging area must hold."""
    return max(max(batch_buckets) * max(tokens_per_seq), max(prefill_tokens, default=0),
               max(mixed_tokens, default=0))


class CudaGraphRunner:
    def __init__(self, step: Step, staging: BatchStaging, batch_buckets: tuple[int, ...],
                 tokens_per_seq: tuple[int, ...], capture: bool = True, prefill_tokens: tuple[int, ...] = (),
                 mixed_tokens: tuple[int, ...] = (), no_replay_seqs: tuple[int, ...] = ()):
        """`mixed_tokens`: capture mixed buckets of these many tokens (none: mixed steps run eagerly), for
        MIXED_SEQS sequences up to the largest batch bucket, chunks up to the largest prefill bucket those tokens hold.
        `no_replay_seqs`: the batch buckets whose single-token steps keep a second graph for steps where no
        sequence replays accepted drafts into its GDN state (graph_bucket.py)."""
        self.step, self.staging, self.capture = step, staging, capture
        self.no_replay_seqs = frozenset(no_replay_seqs) if 1 in tokens_per_seq else frozenset()
        self.batch_buckets, self.tokens_per_seq = tuple(sorted(batch_buckets)), tuple(sorted(tokens_per_seq))
        self.prefill_tokens = tuple(q for q in sorted(prefill_tokens) if q > self.tokens_per_seq[-1])
        # prefill buckets with a second, deep graph: those whose chunks can take wider attention tiles
        self.deep_prefill_tokens = tuple(q for q in self.prefill_tokens if wide_tile_context(q) is not None)
        # a mixed bucket's chunks: up to the largest prefill bucket that its tokens hold (none: no mixed buckets)
        self.mixed_seqlen = max((q for q in self.prefill_tokens if q <= max(mixed_tokens, default=0)), default=0)
        self.mixed_tokens = tuple(sorted(mixed_tokens)) if self.mixed_seqlen else ()
        largest = self.batch_buckets[-1]
        self.mixed_seqs = tuple(sorted({min(b, largest) for b in buckets_for(largest, MIXED_SEQS)})) \
            if self.mixed_tokens else ()
        # (sequences, tokens) -> the mixed bucket of that many
        self.mixed_buckets = {(b, t): Bucket.mixed(b, t, self.mixed_seqlen, self.tokens_per_seq[-1] - 1)
                              for b in self.mixed_seqs for t in self._reachable_tokens(b)}
        if largest > staging.max_seqs or graph_tokens(
                self.batch_buckets, self.tokens_per_seq, self.prefill_tokens, self.mixed_tokens) > staging.max_tokens:
            raise ValueError(f"graph staging area ({staging.max_seqs} sequences, {staging.max_tokens} tokens) "
                             f"is smaller than the largest bucket")
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = None

    def bucket_for(self, plan: StepPlan) -> Bucket | None:
        """The smallest bucket that holds this step, or None when it must run eagerly."""
        if plan.num_seqs == 0:
            return None
        longest = int(plan.seq_lens.max())
        if plan.num_seqs <= self.batch_buckets[-1]:
            q = next((q for q in self.tokens_per_seq if q >= longest), None)
            if q is not None:
                b = next(b for b in self.batch_buckets if b >= plan.num_seqs)
                replays = 0 if q == 1 and b in self.no_replay_seqs and not plan.may_replay else None
                return Bucket.uniform(b, q, replays)
        if plan.num_seqs == 1 and plan.logits_per_seq[0] <= 1 and plan.num_drafts[0] == 0:
            q = next((q for q in self.prefill_tokens if q >= longest), None)
            if q is not None:
                # deep: the chunk itself (not only its bucket) is far enough in for the wide tiles
                wide_from = wide_tile_context(longest)
                deep = q in self.deep_prefill_tokens and wide_from is not None and plan.start_positions[0] >= wide_from
                return Bucket.prefill(q, wide_tile_context(q) if deep else 0)
        return self._mixed_bucket(plan, longest)

    def _reachable_tokens(self, seqs: int) -> tuple[int, ...]:
        """The mixed buckets' token sizes a step of `seqs` sequences can reach: chunks of up to P tokens never need
        more than seqs * P in all, so sizes past the first that holds seqs * P are left out."""
        return self.mixed_tokens[:bisect.bisect_left(self.mixed_tokens, seqs * self.mixed_seqlen) + 1]

    def _mixed_bucket(self, plan: StepPlan, longest: int) -> Bucket | None:
        """The smallest mixed bucket of at least the step's tokens and sequences whose logit rows hold the step's."""
        t = next((t for t in self.mixed_tokens if t >= plan.num_tokens), None)
        if t is None or longest > self.mixed_seqlen:
            return None
        rows = int(plan.logits_per_seq.sum())
        fits = (self.mixed_buckets.get((b, t)) for b in self.mixed_seqs if b >= plan.num_seqs)
        return next((bucket for bucket in fits if bucket is not None and bucket.logit_rows >= rows), None)

    def buckets(self) -> list[Bucket]:
        """Every bucket, in capture order: mixed, prefill, then batch buckets, each group largest first."""
        keys = sorted(self.mixed_buckets.values(), key=lambda b: (b.tokens, b.seqs), reverse=True)
        keys += [Bucket.prefill(q) for q in reversed(self.prefill_tokens)]
        keys += [Bucket.prefill(q, wide_tile_context(q)) for q in reversed(self.deep_prefill_tokens)]
        keys += [Bucket.uniform(b, q) for q in reversed(self.tokens_per_seq) for b in reversed(self.batch_buckets)]
        keys += [Bucket.uniform(b, 1, 0) for b in reversed(self.batch_buckets) if b in self.no_replay_seqs]
        return list(dict.fromkeys(keys))   # k = 0 and one sequence: the mixed bucket is the prefill one of mixed_seqlen

    def is_prefill(self, bucket: Bucket) -> bool:
        """Is this a prefill bucket (one sequence, one logit row, no drafts)?"""
        return (bucket == Bucket.prefill(bucket.max_seqlen, bucket.min_context)
                and bucket.max_seqlen in self.prefill_tokens)

    def is_mixed(self, bucket: Bucket) -> bool:
        """Is this a mixed bucket (and not also a prefill bucket, as one sequence at k = 0 is)?"""
        return self.mixed_buckets.get((bucket.seqs, bucket.tokens)) == bucket and not self.is_prefill(bucket)

    def run(self, plan: StepPlan, bucket: Bucket, before: Callable[[ForwardBatch], object] | None = None
            ) -> tuple[ForwardBatch, tuple[torch.Tensor, ...]]:
        """Stage the padded batch and replay its graph (or run it eagerly without capture). Returns the padded
        batch and the step's padded outputs; rows past the real tokens / logit rows are padding. `before` gets
        the staged batch first (device work queued ahead of the replay, e.g. writing input ids in place)."""
        batch = self.staging.stage(plan, bucket)
        if before is not None:
            before(batch)
        if not self.capture:
            return batch, self.step(batch)
        graph, outputs = self.graphs[bucket]
        graph.replay()
        return batch, outputs

    def capture_all(self) -> None:
        """Capture every bucket (they share one memory pool) in `buckets()` order. Each is warmed up eagerly first
        (Triton compiles) on a batch of padding only, so no sequence's cache is touched."""
        if not self.capture:
            return
        self.pool = torch.cuda.graph_pool_handle()
        for key in tqdm(self.buckets(), desc="capturing CUDA graphs", unit="graph", leave=False):
            try:
                self.graphs[key] = self._capture(key)
            except Exception as e:
                raise RuntimeError(f"capturing the CUDA graph of {key} failed ({type(e).__name__}: {e}); "
                                   f"--enforce-eager runs without graphs") from e
        log.info("captured %d CUDA graphs: batch buckets %s x tokens per sequence %s (single tokens without draft "
                 "replays apart at %s), prefill buckets of one sequence %s (deep ones too: %s), "
                 "mixed buckets of %s sequences x %s tokens",
                 len(self.graphs), self.batch_buckets, self.tokens_per_seq, sorted(self.no_replay_seqs) or "none",
                 self.prefill_tokens, self.deep_prefill_tokens, self.mixed_seqs, self.mixed_tokens)

    def _capture(self, bucket: Bucket) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        batch = self.staging.stage(padding_only_plan(self.staging.max_blocks), bucket)
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
