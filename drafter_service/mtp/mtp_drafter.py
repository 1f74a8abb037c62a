"""MTP drafter: ingests committed tokens + target hidden states into its own KV cache, then drafts k tokens
greedily (argmax), feeding back its own post-norm output (see mtp_head for the formula, draft_loop for the
device-side loop and its CUDA graphs). This file keeps the per-sequence bookkeeping."""
from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from specdec.drafting import DeviceDrafts, DeviceDraftStep, DraftBatch, DraftOutput, ModelFacts, PrefixBlocks
from specdec.drafting.draft_masks import DraftMasks
from specdec.id_pool import PoolExhausted
from specdec.models.batch_staging import concat_ranges
from specdec.models.caches import GDNCache, KVCache, ModelCaches
from specdec.models.loader import LoadedModel
from specdec.models.pinned_upload import PinnedUpload
from specdec.models.model_config import ModelConfig
from specdec.prefix_cache import BlockPool
from specdec.transport.tensor_bytes import DTYPE_NAMES

from .chained_catch_up import ChainedCatchUp
from .draft_loop import MTPDraftLoop, catch_up_plan
from .mtp_head import MTPHead
from .options import MTPOptions
from .prompt_rows import PromptRows
from .sequence_tables import SequenceTables

log = logging.getLogger(__name__)
# prefix checkpoints kept (one block each; dropped, least recently used first, when sequences need the blocks): more
# than a verifier keeps by default (2 x 64 running sequences), so that a checkpoint it resumes from is still here
MAX_CHECKPOINTS = 256


def _linear_around(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear whose weight IS `weight` (no copy)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def mtp_facts(config: ModelConfig, dtype: torch.dtype, vocab_fingerprint: str = "") -> ModelFacts:
    """An MTP head belongs to its target: same hidden size, vocabulary and model type."""
    return ModelFacts(hidden_size=config.hidden_size, vocab_size=config.vocab_size, dtype=DTYPE_NAMES[dtype],
                      model_type=config.model_type, vocab_fingerprint=vocab_fingerprint)


class MTPDrafter:
    kind = "mtp"
    needs_hidden = True
    drafts_on_device = True

    def __init__(self, loaded: LoadedModel, max_drafts: int, num_blocks: int, block_size: int = 16,
                 device: str | torch.device | None = None, options: "MTPOptions | None" = None,
                 draft_masks: DraftMasks | None = None):
        """In-process: share the loaded target's embed_tokens / lm_head (on their device unless told)."""
        self.setup(loaded.config, loaded.mtp_weights, loaded.model.embed_tokens.weight,
                   loaded.model.lm_head.weight, max_drafts, num_blocks, block_size,
                   device if device is not None else loaded.model.embed_tokens.weight.device, options, draft_masks)

    @classmethod
    def from_parts(cls, config: ModelConfig, mtp_weights: dict[str, torch.Tensor], embed_weight: torch.Tensor,
                   lm_head_weight: torch.Tensor, max_drafts: int, num_blocks: int, block_size: int = 16,
                   device: str | torch.device = "cpu", options: "MTPOptions | None" = None,
                   draft_masks: DraftMasks | None = None) -> "MTPDrafter":
        """Out of process: weights read from the folder, or mapped from the verifier (no second copy)."""
        drafter = cls.__new__(cls)
        drafter.setup(config, mtp_weights, embed_weight, lm_head_weight, max_drafts, num_blocks, block_size, device,
                      options, draft_masks)
        return drafter

    def setup(self, config, mtp_weights, embed_weight, lm_head_weight, max_drafts, num_blocks, block_size, device,
              options, draft_masks=None):
        """`draft_masks`: keep constrained sequences' drafts inside their grammars (None: drafts are unmasked)."""
        if not mtp_weights:
            raise ValueError("the checkpoint has no mtp.* tensors: the mtp drafter cannot run (use ngram)")
        options = options or MTPOptions()
        self.head = MTPHead.from_weights(config, mtp_weights, nn.Embedding.from_pretrained(embed_weight),
                                         _linear_around(lm_head_weight))
        self.max_drafts, self.block_size, self.device = max_drafts, block_size, torch.device(device)
        self.facts = mtp_facts(config, embed_weight.dtype)
        num_layers = len(self.head.layers)
        shape = (num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)  # + the scratch block
        dtype = embed_weight.dtype
        kv = KVCache(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                     v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                     block_size=block_size)
        caches = ModelCaches(kv=kv, gdn=GDNCache([], [], []), layer_slot={i: i for i in range(num_layers)})
        self.kv = kv
        self.tables = SequenceTables(BlockPool(num_blocks, "mtp kv blocks"), block_size,
                                     math.ceil(options.max_context / block_size),
                                     MAX_CHECKPOINTS)
        draft_vocab = None if options.draft_vocab is None else torch.as_tensor(options.draft_vocab)
        self.loop = MTPDraftLoop(self.head, caches, max_drafts, options.max_seqs, self.tables.width, self.device,
                                 graphs=not options.enforce_eager, draft_vocab=draft_vocab)
        self.dropped: set[int] = set()  # sequences given up for lack of blocks, until released
        self.draft_masks = draft_masks
        self._upload = PinnedUpload(self.device, buffers=4)   # two uploads a step with PromptRows

    def propose(self, batch: DraftBatch) -> DraftOutput:
        """Sequences this drafter cannot hold (its KV blocks ran out, or longer than max_context) are dropped:
        they get no drafts from then on, and the verifier decodes them without; nothing fails. A sequence first
        seen past position 0 has KV this drafter never built, unless the verifier resumed it from a prefix this
        drafter kept too: else it is reported missing (the verifier recomputes it)."""
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        if self.draft_masks is not None:
            self.draft_masks.ingest(batch.seqs)
        lens = np.fromiter((len(s.token_ids) - 1 for s in batch.seqs), np.int64, count=len(batch.seqs))
        served, missing, prefixes, copies = [], [], {p.seq_id: p for p in batch.prefixes}, []
        for i, s in enumerate(batch.seqs):
            if s.start_pos > 0 and not self._holds(s.seq_id, prefixes.get(s.seq_id), copies):
                missing.append(s.seq_id)
            elif s.seq_id not in self.dropped and self._try_reserve(s.seq_id, s.start_pos + lens[i]) and lens[i] > 0:
                served.append(i)
        self._copy_blocks(copies)
        if served:
            hidden = batch.hidden
            if len(served) < len(batch.seqs):  # rows of the served sequences only
                rows = concat_ranges((np.cumsum(lens) - lens)[served], lens[served])
                hidden = hidden[torch.from_numpy(rows).to(hidden.device)]
            for i, d in zip(served, self._draft([batch.seqs[i] for i in served], hidden)):
                drafts[i] = d
        self._keep_checkpoints(batch.prefixes)
        return DraftOutput(drafts=drafts, missing=missing)

    def _holds(self, seq_id: int, prefix: PrefixBlocks | None, copies: list[tuple[int, int]]) -> bool:
        """Does this drafter hold (or has it dropped) a sequence first seen past position 0? One the verifier
        resumed from a prefix it kept too is taken now: its last block's (source, copy) joins `copies`."""
        if seq_id in self.tables or seq_id in self.dropped:
            return True
        copy = self.tables.resume(seq_id, prefix) if prefix is not None and prefix.resumed else None
        if copy is not None:
            copies.append(copy)
        return copy is not None

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Queue the KV block copies of resumed sequences (indices through pinned memory: no sync)."""
        if copies:
            index = self._upload(np.asarray(copies, np.int64).T.ravel())   # [2 * N]: sources, then copies
            self.kv.copy_blocks(index[:len(copies)], index[len(copies):])

    def _keep_checkpoints(self, prefixes: list[PrefixBlocks]) -> None:
        for prefix in prefixes:
            if prefix.checkpoint:
                self.tables.checkpoint(prefix.seq_id, prefix)

    def _try_reserve(self, seq_id: int, pairs_end: int) -> bool:
        """Blocks for the catch-up pairs (positions < pairs_end) and every draft step after them (a graph drafts
        max_drafts for every sequence)."""
        try:
            self.tables.reserve(seq_id, int(pairs_end) + self.max_drafts - 1)
            return True
        except (PoolExhausted, ValueError) as e:
            log.warning("sequence %d dropped by the mtp drafter (%s): it decodes without drafts", seq_id, e)
            self.release([seq_id])
            self.dropped.add(seq_id)
            return False

    def _draft(self, seqs, hidden: torch.Tensor) -> list[list[int]]:
        ks = [min(s.num_drafts, self.max_drafts) for s in seqs]
        tables, table_lens = self.tables.rows([s.seq_id for s in seqs])
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, count=len(seqs))
        plan = catch_up_plan([s.token_ids for s in seqs], starts, tables, table_lens)
        walk = None
        if self.draft_masks is not None and max(ks) > 0:
            walk = self.draft_masks.walk([s.seq_id for s in seqs], self.device, self.loop.vocab_ids)
        try:
            drafted = self.loop.run(plan, hidden, max(ks), walk=walk).tolist()  # [B, >= max(ks)]: the last sync
        finally:
            if walk is not None:
                walk.close()
        if walk is not None:   # (the loop drafted max(ks) steps for every row)
            ks = walk.counts(ks, [row[max(ks) - 1] for row in drafted])
        return [row[:k] for row, k in zip(drafted, ks)]

    def draft_on_device(self, step: DeviceDraftStep) -> DeviceDrafts:
        """Catch up on a step the verifier has not read (its rows, on the device) and draft, with no sync. As in
        propose(), a sequence this drafter cannot hold gets no drafts, and one first seen past position 0 is
        reported missing; both are left out of the catch-up. Prompt chunks beside decoding sequences are ingested
        but for their last rows first (PromptRows), so that the catch-up replays a batch bucket's graph."""
        held, missing, copies = np.zeros(len(step.seq_ids), bool), [], []
        prefixes = {p.seq_id: p for p in step.prefixes}
        for i, (seq_id, start, shift, n) in enumerate(zip(step.seq_ids, step.start_pos, step.max_shift,
                                                         step.chunk_lens)):
            if start > 0 and not self._holds(seq_id, prefixes.get(seq_id), copies):
                missing.append(seq_id)
            else:
                held[i] = seq_id not in self.dropped and self._try_reserve(seq_id, int(start + shift + n))
        self._copy_blocks(copies)
        counts = [min(int(k), self.max_drafts) if ok else 0 for k, ok in zip(step.num_drafts, held)]
        if not held.any():
            self._keep_checkpoints(step.prefixes)
            return DeviceDrafts(torch.zeros(len(counts), self.max_drafts, dtype=torch.long, device=self.device),
                                counts, missing)
        skip = self.loop.prompt_skip(step.chunk_lens, held)
        if skip is not None:   # prompt chunks beside decoding sequences: their front rows first (catch-up only)
            front = PromptRows(step, skip, self.block_size, self._upload)
            tables, table_lens = self.tables.rows([i for i, ok in zip(step.seq_ids, front.held) if ok])
            self.loop.run(front.plan(tables, table_lens), front.hidden(), 0, front)
        catch_up = ChainedCatchUp(step, held, self.block_size, self._upload, skip)
        tables, table_lens = self.tables.rows([i for i, ok in zip(step.seq_ids, held) if ok])
        # A step that asks for no drafts (the verifier's draft policy chose k = 0) only catches up: one head
        # forward, no draft steps and no lm_head (the loop's catch-up graphs, or eagerly where none holds the step).
        steps = self.max_drafts if max(counts, default=0) > 0 else 0
        drafts = self.loop.run(catch_up.plan(tables, table_lens, held), catch_up.hidden(), steps, catch_up)
        if steps == 0:
            drafts = torch.zeros(drafts.shape[0], self.max_drafts, dtype=torch.long, device=self.device)
        self._keep_checkpoints(step.prefixes)
        return DeviceDrafts(catch_up.scatter(drafts), counts, missing)

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.tables.release(i)
            self.dropped.discard(i)
        if self.draft_masks is not None:
            self.draft_masks.release(seq_ids)

    def clear(self) -> None:
        self.release(self.tables.seq_ids())
        if self.draft_masks is not None:
            self.draft_masks.clear()
