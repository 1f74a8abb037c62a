"""Owns the target model and its caches; turns sequences into one ragged ForwardBatch and runs it."""
from __future__ import annotations

import math

import torch

from specdec.id_pool import IdPool
from specdec.models.caches import ModelCaches
from specdec.models.forward_batch import ForwardBatch
from specdec.models.loader import LoadedModel

from .sequence import Sequence


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, max_seqs: int,
                 max_drafts: int = 0, device: str | torch.device = "cpu"):
        self.config, self.model = loaded.config, loaded.model
        self.block_size, self.device = block_size, torch.device(device)
        dtype = loaded.model.embed_tokens.weight.dtype
        self.caches = ModelCaches.allocate(self.config, num_blocks, block_size, max_seqs, max_drafts,
                                           dtype=dtype, device=self.device)
        self.blocks = IdPool(num_blocks, "kv blocks")
        self.gdn_slots = IdPool(max_seqs, "gdn slots")

    # ---- cache ownership ---------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, length: int) -> int:
        return max(0, math.ceil(length / self.block_size) - len(seq.block_table))

    def reserve(self, seq: Sequence, length: int) -> None:
        """Make sure `seq` has a GDN slot and KV blocks for positions < length."""
        if seq.gdn_slot < 0:
            seq.gdn_slot = self.gdn_slots.take()[0]
            self.caches.gdn.reset(seq.gdn_slot)
            seq.gdn_read_offset = 0
        seq.block_table += self.blocks.take(self.blocks_needed(seq, length))

    def release(self, seq: Sequence) -> None:
        self.blocks.give_back(seq.block_table)
        seq.block_table = []
        if seq.gdn_slot >= 0:
            self.gdn_slots.give_back([seq.gdn_slot])
        seq.gdn_slot, seq.num_cached, seq.gdn_read_offset = -1, 0, 0

    # ---- one forward -------------------------------------------------------------------
    def forward(self, seqs: list[Sequence], chunks: list[list[int]], num_drafts: list[int] | None = None,
                logits: str = "last") -> tuple[torch.Tensor, torch.Tensor]:
        """Run `chunks[i]` (tokens after seqs[i].num_cached) for every sequence; returns (hidden, logits).
        The caller advances num_cached / gdn_read_offset once it knows what was committed."""
        for seq, chunk in zip(seqs, chunks):
            self.reserve(seq, seq.num_cached + len(chunk))
        batch = ForwardBatch.build(
            chunks, [s.num_cached for s in seqs], [s.block_table for s in seqs], self.block_size,
            [s.gdn_slot for s in seqs], [s.gdn_read_offset for s in seqs], num_drafts, logits, self.device)
        return self.model(batch, self.caches)
