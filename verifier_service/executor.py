"""The engine's one door to the target model: it runs a step of scheduled sequences and owns what that takes, the
block manager (which sequence holds which cache blocks and slot) and the model runner (the model, its caches,
the staging area and the CUDA graphs).

The step crosses this boundary as a StepPlan (numpy arrays: token ids, positions, block tables, slots, drafts,
logit rows). One process drives one device, or, under tensor parallelism, this process is rank 0 of a RankGroup
(rank_group.py): each step's plan goes to every rank, each runs the identical step on its shard, and rank 0 keeps
the scheduling and the sampling.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from specdec.models.batch_staging import StepPlan, logit_rows_per_seq
from specdec.models.forward_batch import ForwardBatch, as_array
from specdec.models.loader import LoadedModel

from .block_manager import BlockManager, PrefixCaching
from .model_runner import BeforeStep, ModelRunner
from .rank_group import RankGroup, RankSpec
from .step_message import StepMessage
from .sequence import Sequence


class Executor:
    def __init__(self, runner: ModelRunner, ranks: RankGroup | None = None, prefix: PrefixCaching | None = None):
        """`prefix`: prefix caching's settings (default: on if the runner has checkpoint rows, over all of them)."""
        self.runner, self.ranks = runner, ranks
        prefix = prefix or PrefixCaching(runner.num_checkpoints > 0, num_checkpoints=runner.num_checkpoints)
        if prefix.enabled and prefix.num_checkpoints > runner.num_checkpoints:
            raise ValueError(f"{prefix.num_checkpoints} prefix checkpoints asked, the caches hold "
                             f"{runner.num_checkpoints}")
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, runner.max_seqs, runner.max_blocks_per_seq,
                                   prefix)

    @staticmethod
    def build(loaded: LoadedModel, num_blocks: int, block_size: int, max_seqs: int, max_drafts: int = 0,
              device: str | torch.device = "cpu", max_model_len: int | None = None, max_batched_tokens: int = 512,
              enforce_eager: bool = False, prefix: PrefixCaching = PrefixCaching(enabled=False)) -> "Executor":
        num_checkpoints = prefix.num_checkpoints if prefix.enabled else 0
        return Executor(ModelRunner(loaded, num_blocks, block_size, max_seqs, max_drafts, device, max_model_len,
                                    max_batched_tokens, enforce_eager, num_checkpoints), prefix=prefix)

    @staticmethod
    def build_parallel(spec: RankSpec, prefix: PrefixCaching | None = None) -> "Executor":
        """Rank 0 of spec.size tensor-parallel ranks (started here, each loading its shard)."""
        ranks = RankGroup(spec)
        try:
            return Executor(ranks.build_runner(), ranks, prefix)
        except BaseException:
            ranks.stop_processes(wait_s=0)
            raise

    def close(self) -> None:
        """Stop the other ranks, if any (this executor runs no step after)."""
        if self.ranks is not None:
            self.runner.graphs = None   # the graphs hold the communicator the teardown frees
            self.ranks.close()

    @property
    def config(self):
        return self.runner.config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def pads_batches(self) -> bool:
        """Do steps replay CUDA graphs? A decode or verify step's bucket then pads every sequence to 1 + the
        engine's k tokens as soon as one verifies drafts: one that verifies none beside them costs what they do
        (a step beside prompt chunks is padded by its tokens in all instead)."""
        return self.runner.graphs is not None

    @property
    def last_batch(self) -> ForwardBatch | None:
        """The staged (padded) batch of the last step."""
        return self.runner.last_batch

    def forward(self, seqs: list[Sequence], chunks: list[list[int]], num_drafts: list[int] | None = None,
                logits: str | list[int] = "last", before: BeforeStep | None = None,
                checkpoints: list[int] | None = None, replays_on_device: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `chunks[i]` (tokens after seqs[i].num_cached) for every sequence; returns (hidden [T, H], logits
        [N, V]), valid until the next step. The caller advances num_cached / gdn_read_offset once it knows what
        was committed. `logits`: "last", "all", or logit rows per sequence (its last tokens). `checkpoints[i]` > 0:
        chunk i ends at the prefix checkpoint of that many blocks (its state is kept after the step).
        `replays_on_device`: the most accepted drafts `before` adds to a sequence's GDN read offset."""
        for seq, chunk in zip(seqs, chunks):
            self.blocks.reserve(seq, seq.num_cached + len(chunk))
        for seq, m in zip(seqs, checkpoints or ()):
            if m:
                self.blocks.checkpoint(seq, m * self.block_size - 1)
        ops = self.blocks.take_cache_ops()
        plan = self.plan(seqs, chunks, num_drafts, logits, replays_on_device)
        if self.ranks is None:
            self.runner.apply_before(ops)
            out = self.runner.run(plan, before)
            self.runner.apply_after(ops)
            return out
        share = before is not None   # rank 0's inputs rewritten from the unread verdict go to the others
        self.ranks.send(StepMessage(plan, ops, share))
        self.runner.apply_before(ops)
        try:
            out = self.runner.run(plan, before, share_inputs=share)
        except RuntimeError as e:   # a collective that lost its peer: say which rank, if one exited
            self.ranks.explain(e)
            raise
        self.runner.apply_after(ops)
        return out

    def plan(self, seqs: list[Sequence], chunks: list[list[int]], num_drafts: list[int] | None,
             logits: str | list[int], replays_on_device: int = 0) -> StepPlan:
        b = len(seqs)
        lens = np.fromiter(map(len, chunks), np.int64, count=b)
        slots = np.fromiter((s.gdn_slot for s in seqs), np.int32, count=b)
        drafts = np.zeros(b, np.int32) if num_drafts is None else as_array(num_drafts, "num_drafts", b, np.int32)
        table_lens = np.fromiter((len(s.block_table) for s in seqs), np.int64, count=b)
        return StepPlan(
            token_ids=np.fromiter(chain.from_iterable(chunks), np.int64, count=int(lens.sum())),
            seq_lens=lens, start_positions=np.fromiter((s.num_cached for s in seqs), np.int64, count=b),
            block_tables=self.blocks.tables(slots, int(table_lens.max(initial=0))), table_lens=table_lens,
            gdn_slots=slots, gdn_read_offsets=np.fromiter((s.gdn_read_offset for s in seqs), np.int32, count=b),
            num_drafts=drafts, logits_per_seq=logit_rows_per_seq(logits, lens), replays_on_device=replays_on_device)
