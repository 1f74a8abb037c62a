"""The MTP draft loop on the device: catch-up over the newly committed pairs, then k greedy draft steps, fed
back without leaving the device (no host sync inside; one read of the [B, k] drafts at the end), unless grammar
masks keep a constrained sequence's drafts inside its grammar (specdec/drafting/draft_masks.py: the step then runs
eagerly and the host walks each draft step's drafts).

One step of B sequences:
    out  = head(catch-up pairs (token at p + 1, target hidden at p), layer 0)[last pair of each sequence]  # [B, H]
    pos  = position of that last pair + 1                                                                # [B]
    for j in 0..k-1:
        d_j = argmax(lm_head(out))            (over the reduced vocabulary when given, mapped to target ids;
                                               over what its grammar allows, for a constrained sequence)
        out = head((d_j at pos + j, out), layer (j + 1) % L)          (not after the last draft)
The draft-step KV rows are written at pos + j, inside the blocks the drafter reserved; the next catch-up
overwrites whatever of them the verifier did not commit, before anything reads them.

On CUDA the whole step is captured per batch-size bucket (specdec.models.cuda_graph_runner) with the catch-up
padded to k + 1 tokens per sequence, and for one sequence's prompt chunk alone in prefill buckets. Prompt chunks
beside other sequences on the device path leave all but their last rows to an eager ingest first (prompt_skip),
and the rest replays a batch bucket; other catch-ups run eagerly with the same code. A step that asks for no
drafts (the verifier's draft policy chose k = 0) replays a second set of graphs of the same batch buckets that
only catch up (catch_up_graphs, their own memory pool).
"""
from __future__ import annotations

import logging
from itertools import chain
from typing import Callable

import numpy as np
import torch

from specdec.drafting.draft_masks import DraftWalk
from specdec.models.batch_staging import BatchStaging, StepPlan
from specdec.models.caches import ModelCaches
from specdec.models.cuda_graph_runner import (
    BATCH_BUCKETS,
    PREFILL_TOKENS,
    CudaGraphRunner,
    buckets_for,
    graph_tokens,
)
from specdec.models.forward_batch import ForwardBatch

from .mtp_head import MTPHead

MAX_STEP_TOKENS = 2048   # the verifier's largest step on a GPU by default (its --max-batched-tokens)

log = logging.getLogger(__name__)


class MTPDraftLoop:
    def __init__(self, head: MTPHead, caches: ModelCaches, max_drafts: int, max_seqs: int, max_blocks: int,
                 device: torch.device, graphs: bool, draft_vocab: torch.Tensor | None = None):
        """`draft_vocab`: target ids [V'] the drafter may propose (a hot subset), or None for all of them."""
        self.head, self.caches, self.max_drafts, self.device = head, caches, max_drafts, device
        self.block_size = caches.kv.block_size
        scratch = caches.kv.scratch_block
        hidden = head.fc.weight.shape[0]
        self.staging = BatchStaging(256, max_seqs, max_blocks, self.block_size, device, scratch_block=scratch)
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self.unit_cu = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)   # [B + 1] one token each
        self.unit_rows = self.unit_cu.long()                                            # [B + 1] int64
        self.hidden_in = torch.zeros(0, hidden, dtype=head.fc.weight.dtype, device=device)  # [bucket tokens, H]
        self.vocab_ids, self.vocab_head = None, None
        if draft_vocab is not None:
            self.set_draft_vocab(draft_vocab)
        self.graphs: CudaGraphRunner | None = None
        self.catch_up_graphs: CudaGraphRunner | None = None   # the same batch buckets, no draft step (k = 0)
        if graphs and device.type == "cuda":
            self.use_graphs(capture=True)

    def use_graphs(self, capture: bool = True) -> None:
        """Run steps with short catch-ups padded to batch buckets x (k + 1) tokens, and one sequence's catch-up
        of up to the largest prefill bucket's tokens alone in a prefill bucket: replayed CUDA graphs with
        `capture`, else the same padded batches eagerly (CPU tests of the padding)."""
        buckets = buckets_for(self.max_seqs, BATCH_BUCKETS)
        prefill = buckets_for(MAX_STEP_TOKENS, PREFILL_TOKENS)     # a longer catch-up runs eagerly
        staging = BatchStaging(graph_tokens(buckets, (self.max_drafts + 1,), prefill), buckets[-1],
                               self.max_blocks, self.block_size, self.device, scratch_block=self.staging.scratch_block)
        self.hidden_in = torch.zeros(staging.max_tokens, self.hidden_in.shape[1], dtype=self.hidden_in.dtype,
                                     device=self.device)                              # [bucket tokens, H]
        self._grow_unit(buckets[-1])
        self.graphs = CudaGraphRunner(self._graph_step, staging, buckets, (self.max_drafts + 1,), capture=capture,
                                      prefill_tokens=prefill)
        self.graphs.capture_all()
        self.catch_up_graphs = CudaGraphRunner(self._catch_up_graph_step, staging, buckets, (self.max_drafts + 1,),
                                               capture=capture)
        self.catch_up_graphs.capture_all()

    def prompt_skip(self, chunk_lens: np.ndarray, held: np.ndarray) -> np.ndarray | None:
        """Rows of each held chunk to ingest ahead of the catch-up (PromptRows) so that the rest fits a batch
        bucket: all but the last row of every chunk longer than k + 1 rows. None where the catch-up fits a bucket
        as it is (decoding sequences only, or one chunk alone in a prefill bucket) or runs eagerly anyway (no
        graphs). Invariant: such a chunk has no drafts in it, so every row is committed (a prompt chunk, or a
        preempted sequence's tokens again). The drafts a held sequence verifies are this drafter's, at most k
        (k + 1 rows with the bonus row); one whose context another drafter built is reported missing, not held."""
        long = held & (chunk_lens > self.max_drafts + 1)
        if self.graphs is None or not long.any():
            return None
        if held.sum() == 1 and chunk_lens[held][0] <= max(self.graphs.prefill_tokens, default=0):
            return None
        return np.where(long, chunk_lens - 1, 0)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Draft over these target ids only: lm_head rows gathered once ([V', H], a copy of V'/V of lm_head)."""
        _, lm_head = self.head.shared
        check_draft_vocab(ids, lm_head.weight.shape[0])
        self.vocab_ids = ids.to(device=self.device, dtype=torch.long)                          # [V']
        self.vocab_head = lm_head.weight.index_select(0, self.vocab_ids)                      # [V', H]

    def run(self, plan: StepPlan, hidden: torch.Tensor, num_steps: int,
            before: Callable[[ForwardBatch], None] | None = None, walk: DraftWalk | None = None) -> torch.Tensor:
        """Catch up on `plan` (hidden [T, H]: the target's rows for its tokens) and draft. Returns drafts
        [B, num_steps] (a graph replay drafts max_drafts steps; the caller keeps what it asked for). `before`
        gets the staged batch first: device work that writes into it what the host does not know. `walk`: grammar
        masks on the draft steps' logits (eager: the host walks each step's drafts)."""
        graphs = self.graphs if num_steps > 0 else self.catch_up_graphs
        bucket = graphs.bucket_for(plan) if graphs is not None and walk is None else None
        if bucket is not None:
            self.hidden_in[: plan.num_tokens].copy_(hidden)
            _, (drafts,) = graphs.run(plan, bucket, before)
            return drafts[: plan.num_seqs]
        if plan.num_tokens > self.staging.max_tokens or plan.num_seqs > self.staging.max_seqs:
            s = self.staging
            self.staging = BatchStaging(max(s.max_tokens, 1 << (plan.num_tokens - 1).bit_length()),
                                        max(s.max_seqs, plan.num_seqs), s.max_blocks, self.block_size,
                                        self.device, scratch_block=s.scratch_block)
        batch = self.staging.stage(plan)
        if before is not None:
            before(batch)
        return self._step(batch, hidden, num_steps, walk)

    def _graph_step(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        return (self._step(batch, self.hidden_in[: batch.num_tokens], self.max_drafts),)

    def _catch_up_graph_step(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        return (self._step(batch, self.hidden_in[: batch.num_tokens], 0),)

    @torch.inference_mode()
    def _step(self, batch: ForwardBatch, hidden: torch.Tensor, num_steps: int,
              walk: DraftWalk | None = None) -> torch.Tensor:
        last = batch.logits_indices[: batch.num_seqs]          # [B] a bucket pads logit rows past B: cut them
        out = self.head(batch, hidden, self.caches, layer=0)[last]                    # [B, H]
        next_pos = batch.positions[last] + 1                                          # [B] int64
        drafts = []
        for j in range(num_steps):
            drafts.append(self._argmax(out, walk, drafts[-1] if drafts else None))   # [B] target ids
            if j + 1 == num_steps:
                break
            feed = self._feed(batch, drafts[-1], next_pos + j)
            out = self.head(feed, out, self.caches, layer=(j + 1) % len(self.head.layers))
        if not drafts:
            return torch.empty(batch.num_seqs, 0, dtype=torch.long, device=out.device)
        return torch.stack(drafts, dim=1)                                            # [B, num_steps]

    def _argmax(self, out: torch.Tensor, walk: DraftWalk | None = None, previous: torch.Tensor | None = None
                ) -> torch.Tensor:
        logits = self.head.logits(out) if self.vocab_ids is None else out @ self.vocab_head.t()     # [B, V']
        if walk is not None:
            logits = walk.masked(logits, previous)
        ids = logits.argmax(-1)
        return ids if self.vocab_ids is None else self.vocab_ids[ids]

    def _feed(self, batch: ForwardBatch, tokens: torch.Tensor, positions: torch.Tensor) -> ForwardBatch:
        """One token per sequence at `positions` [B], KV rows from the sequence's own block table."""
        b = batch.num_seqs
        self._grow_unit(b)
        column = (positions // self.block_size).clamp_(max=batch.block_tables.shape[1] - 1)     # [B]
        blocks = batch.block_tables.gather(1, column[:, None].to(torch.long))[:, 0]             # [B] int32
        slots = blocks.to(torch.long) * self.block_size + positions % self.block_size        # [B]
        return ForwardBatch(input_ids=tokens, positions=positions, cu_seqlens=self.unit_cu[: b + 1],
                            block_tables=batch.block_tables, slot_mapping=slots, gdn_slots=batch.gdn_slots,
                            gdn_read_offsets=batch.gdn_read_offsets, num_drafts=batch.num_drafts,
                            logits_indices=self.unit_rows[:b], num_seqs=b, num_tokens=b, max_seqlen=1)

    def _grow_unit(self, num_seqs: int) -> None:
        """cu_seqlens / logit rows of one token per sequence for up to num_seqs (grown for big eager steps)."""
        if self.unit_cu.shape[0] <= num_seqs:
            self.unit_cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=self.device)
            self.unit_rows = self.unit_cu.long()


def check_draft_vocab(ids: torch.Tensor, vocab_size: int) -> None:
    """A draft vocabulary is a non-empty set of distinct target ids."""
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError("draft vocabulary: expected a non-empty list of token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary: ids outside the target vocabulary [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("draft vocabulary: an id repeats")


def catch_up_plan(token_chunks: list[list[int]], start_positions: np.ndarray, tables: np.ndarray,
                  table_lens: np.ndarray) -> StepPlan:
    """Pairs (token at p + 1, hidden at p): each sequence's tokens after its first, at start_pos onwards."""
    b = len(token_chunks)
    lens = np.fromiter((len(c) - 1 for c in token_chunks), np.int64, count=b)
    ids = np.fromiter(chain.from_iterable(c[1:] for c in token_chunks), np.int64, count=int(lens.sum()))
    return pairs_plan(ids, lens, start_positions, tables, table_lens)


def pairs_plan(token_ids: np.ndarray, seq_lens: np.ndarray, start_positions: np.ndarray, tables: np.ndarray,
               table_lens: np.ndarray) -> StepPlan:
    """A draft-loop batch of these pairs' layout: one logit row per sequence, no drafts, no GDN state (token ids
    zeros where the device writes them)."""
    zeros = np.zeros(len(seq_lens), np.int32)
    return StepPlan(token_ids=token_ids, seq_lens=seq_lens, start_positions=start_positions, block_tables=tables,
                    table_lens=table_lens, gdn_slots=zeros, gdn_read_offsets=zeros, num_drafts=zeros,
                    logits_per_seq=np.ones(len(seq_lens), np.int64))
