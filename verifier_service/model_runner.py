"""Owns the target model and its caches, and runs one step: a StepPlan (numpy, one entry per sequence, built by the
executor from the scheduled sequences and the block manager's tables) staged to the device with one copy, and run
either eagerly or, on CUDA, by replaying a CUDA graph: decode / verify steps, a prompt chunk of up to 4096 tokens
that runs alone (as far as the token budget reaches), and steps that mix prompt chunks with other sequences in up
to 1024 tokens (specdec/models/cuda_graph_runner.py). It holds no sequence state: which blocks and slots a
sequence has is the block manager's.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import numpy as np
import torch

from specdec.models.batch_staging import BatchStaging, StepPlan
from specdec.models.caches import ModelCaches
from specdec.models.cuda_graph_runner import (
    BATCH_BUCKETS,
    MIXED_TOKENS,
    PREFILL_TOKENS,
    CudaGraphRunner,
    buckets_for,
    graph_tokens,
)
from specdec.models.forward_batch import ForwardBatch
from specdec.models.fused_linear import fuse_projections
from specdec.models.gated_deltanet import CHUNKED_PREFILL_MIN_TOKENS, replays_change_launch
from specdec.models.loader import LoadedModel
from specdec.models.pinned_upload import PinnedUpload

from .block_manager import CacheOps

log = logging.getLogger(__name__)
BeforeStep = Callable[[ForwardBatch], None]   # device work on the staged batch, queued before the step runs


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, max_seqs: int,
                 max_drafts: int = 0, device: str | torch.device = "cpu", max_model_len: int | None = None,
                 max_batched_tokens: int = 512, enforce_eager: bool = False, num_checkpoints: int = 0):
        """`max_model_len` bounds a sequence's length (block-table width; default: what the KV blocks hold,
        capped by the model's max positions). CUDA graphs are captured here on CUDA unless `enforce_eager`.
        `num_checkpoints`: GDN / conv state rows after the sequences' slots, for prefix-cache checkpoints."""
        self.config, self.model = loaded.config, loaded.model
        fuse_projections(self.model)  # (load_model did; a model built otherwise is fused here, before capture)
        self.block_size, self.device, self.max_drafts = block_size, torch.device(device), max_drafts
        self.num_blocks, self.max_seqs, self.num_checkpoints = num_blocks, max_seqs, num_checkpoints
        dtype = loaded.model.embed_tokens.weight.dtype
        self.tp = self.model.tp   # tensor parallelism: this rank's caches hold its shard's heads
        self.caches = ModelCaches.allocate(self.model.config, num_blocks, block_size, max_seqs + num_checkpoints,
                                           max_drafts,
                                           dtype=dtype, device=self.device)
        max_len = max_model_len or min(num_blocks * block_size, self.config.max_position_embeddings)
        self.max_blocks_per_seq = math.ceil(max_len / block_size)
        self.max_batched_tokens = max_batched_tokens
        self.staging = self._new_staging(max_batched_tokens, max_seqs)
        self.epilogue: Callable[[ForwardBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] | None = None
        self.graphs: CudaGraphRunner | None = None
        self.last_outputs: tuple[torch.Tensor, ...] = ()
        self.last_batch: ForwardBatch | None = None   # the staged (padded) batch of the last forward
        self._upload_pairs = PinnedUpload(self.device, buffers=4)   # cache ops' indices (two uploads a step)
        if self.device.type == "cuda" and not enforce_eager:
            self.use_graphs(capture=True)

    def _new_staging(self, max_tokens: int, max_seqs: int) -> BatchStaging:
        return BatchStaging(max_tokens, max_seqs, self.max_blocks_per_seq, self.block_size, self.device,
                            scratch_block=self.caches.kv.scratch_block, scratch_gdn_slot=self.caches.gdn.scratch_slot)

    def use_graphs(self, capture: bool = True, batch_buckets: tuple[int, ...] = BATCH_BUCKETS) -> None:
        """Run decode / verify steps in padded batch-size buckets, a prompt chunk alone in a prefill bucket and
        a step mixing prompt chunks with other sequences in a mixed bucket (prefill and mixed buckets only as
        large as the token budget needs): replayed CUDA graphs with `capture`, else the same padded batches
        eagerly (CPU tests). Set `epilogue` before this: it is captured with the step."""
        buckets = buckets_for(self.max_seqs, batch_buckets)
        tokens_per_seq = (1,) if self.max_drafts == 0 else (1, 1 + self.max_drafts)
        prefill = buckets_for(self.max_batched_tokens, PREFILL_TOKENS)
        mixed = buckets_for(self.max_batched_tokens, MIXED_TOKENS)
        staging = self._new_staging(graph_tokens(buckets, tokens_per_seq, prefill, mixed), buckets[-1])
        no_replay = tuple(b for b in buckets if replays_change_launch(b, self.max_drafts))
        self.graphs = CudaGraphRunner(self._step, staging, buckets, tokens_per_seq, capture=capture,
                                      prefill_tokens=prefill, mixed_tokens=mixed, no_replay_seqs=no_replay)
        # a prefill bucket captures the recurrent GDN kernel or, from CHUNKED_ONE_MIN_TOKENS, the one-sequence
        # chunked one; a mixed bucket's chunks must not reach the varlen chunked path (host offsets), which cannot
        # be captured
        if self.graphs.mixed_seqlen >= CHUNKED_PREFILL_MIN_TOKENS:
            raise ValueError(f"mixed buckets of chunks up to {self.graphs.mixed_seqlen} tokens reach the chunked GDN "
                             f"prefill of several sequences ({CHUNKED_PREFILL_MIN_TOKENS} tokens), which graphs do "
                             "not capture")
        self.graphs.capture_all()

    def apply_before(self, ops: CacheOps) -> None:
        """Before a step (queued on the device): zero the GDN / conv state of slots newly given to sequences, restore
        resumed ones from their checkpoints' rows, copy the KV blocks of resumed prefixes."""
        for slot in ops.fresh_slots:
            self.caches.gdn.reset(slot)
        if ops.restores:
            self.caches.gdn.copy_rows(*self._index_pairs(ops.restores))
        if ops.block_copies:
            self.caches.kv.copy_blocks(*self._index_pairs(ops.block_copies))

    def apply_after(self, ops: CacheOps) -> None:
        """After a step: save the GDN / conv state of sequences at a checkpoint into its row."""
        if ops.saves:
            self.caches.gdn.copy_rows(*self._index_pairs(ops.saves))

    def _index_pairs(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sources [N], destinations [N]) on the device, through pinned memory (no wait for the device)."""
        index = self._upload_pairs(np.asarray(pairs, np.int64).T.ravel())   # [2 * N]
        return index[:len(pairs)], index[len(pairs):]

    # ---- one step ----------------------------------------------------------------------
    def run(self, plan: StepPlan, before: BeforeStep | None = None, share_inputs: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step `plan` describes; returns (hidden [T, H], logits [N, V]), valid until the next step.
        Outputs of the epilogue (padded) are in `last_outputs[2:]`. `before` gets the staged batch before the step
        runs: device work that writes what the host does not know yet (a running step's tokens and accepted
        counts) into it. The batch is `last_batch` after. `share_inputs` (tensor parallelism, every rank):
        rank 0's staged inputs, `before` applied, replace the other ranks' (they know no unread verdict)."""
        self._check_drafts(plan)
        bucket = self.graphs.bucket_for(plan) if self.graphs is not None else None
        if share_inputs:
            before = self._sharing(before, bucket is not None)
        if bucket is not None:
            batch, outputs = self.graphs.run(plan, bucket, before)
        else:
            batch = self._stage_eager(plan)
            if before is not None:
                before(batch)
            outputs = self._step(batch)
        self.last_outputs, self.last_batch = outputs, batch
        hidden, logits_out = outputs[0], outputs[1]
        return hidden[: plan.num_tokens], logits_out[: int(plan.logits_per_seq.sum())]

    def _sharing(self, before: BeforeStep | None, in_graph: bool) -> BeforeStep:
        def share(batch: ForwardBatch) -> None:
            if before is not None:
                before(batch)
            self.tp.broadcast((self.graphs.staging if in_graph else self.staging).step_inputs)
        return share

    def _step(self, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        hidden, logits = self.model(batch, self.caches)
        if self.epilogue is None:
            return hidden, logits
        return hidden, logits, *self.epilogue(batch, hidden, logits)

    def _stage_eager(self, plan: StepPlan) -> ForwardBatch:
        if plan.num_tokens > self.staging.max_tokens or plan.num_seqs > self.staging.max_seqs:
            tokens = 1 << max(plan.num_tokens - 1, 0).bit_length()
            self.staging = self._new_staging(max(tokens, self.staging.max_tokens),
                                             max(plan.num_seqs, self.staging.max_seqs))
            log.info("eager staging area grown to %d tokens", self.staging.max_tokens)
        return self.staging.stage(plan)

    def _check_drafts(self, plan: StepPlan) -> None:
        """What the GDN ring of draft inputs relies on (kernels/gated_delta_rule/reference.py): at most max_drafts
        drafts stashed or replayed, and a step with drafts is its last token plus the drafts (else the entries it
        stashes could alias the ones it replays)."""
        lens, drafts, offsets = plan.seq_lens, plan.num_drafts, plan.gdn_read_offsets
        bad = ((drafts < 0) | (drafts > self.max_drafts) | (offsets < 0) | (offsets > self.max_drafts)
               | ((drafts > 0) & (lens != 1 + drafts)))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"step of sequence #{i}: {int(lens[i])} tokens, {int(drafts[i])} drafts, read offset "
                             f"{int(offsets[i])}; this runner takes 0..{self.max_drafts} drafts, each step with "
                             f"drafts being one token plus its drafts")
