"""MTP drafter: ingests committed tokens + target hidden states into its own KV cache, then drafts k tokens
greedily (argmax), feeding back its own post-norm output (see mtp_head for the formula)."""
from __future__ import annotations

import logging
import math

import torch
from torch import nn

from specdec.drafting import DraftBatch, DraftOutput, ModelFacts
from specdec.id_pool import IdPool, PoolExhausted
from specdec.models.caches import GDNCache, KVCache, ModelCaches
from specdec.models.forward_batch import ForwardBatch
from specdec.models.loader import LoadedModel
from specdec.models.model_config import ModelConfig
from specdec.transport.tensor_bytes import DTYPE_NAMES

from .mtp_head import MTPHead

log = logging.getLogger(__name__)


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

    def __init__(self, loaded: LoadedModel, max_drafts: int, num_blocks: int, block_size: int = 16,
                 device: str | torch.device | None = None):
        """In-process: share the loaded target's embed_tokens / lm_head (on their device unless told)."""
        self.setup(loaded.config, loaded.mtp_weights, loaded.model.embed_tokens.weight,
                   loaded.model.lm_head.weight, max_drafts, num_blocks, block_size,
                   device if device is not None else loaded.model.embed_tokens.weight.device)

    @classmethod
    def from_parts(cls, config: ModelConfig, mtp_weights: dict[str, torch.Tensor], embed_weight: torch.Tensor,
                   lm_head_weight: torch.Tensor, max_drafts: int, num_blocks: int, block_size: int = 16,
                   device: str | torch.device = "cpu") -> "MTPDrafter":
        """Out of process: weights read from the folder, or mapped from the verifier (no second copy)."""
        drafter = cls.__new__(cls)
        drafter.setup(config, mtp_weights, embed_weight, lm_head_weight, max_drafts, num_blocks, block_size, device)
        return drafter

    def setup(self, config, mtp_weights, embed_weight, lm_head_weight, max_drafts, num_blocks, block_size, device):
        if not mtp_weights:
            raise ValueError("the checkpoint has no mtp.* tensors: the mtp drafter cannot run (use ngram)")
        self.head = MTPHead.from_weights(config, mtp_weights, nn.Embedding.from_pretrained(embed_weight),
                                         _linear_around(lm_head_weight))
        self.max_drafts, self.block_size, self.device = max_drafts, block_size, torch.device(device)
        self.facts = mtp_facts(config, embed_weight.dtype)
        num_layers = len(self.head.layers)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        dtype = embed_weight.dtype
        kv = KVCache(k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                     v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                     block_size=block_size)
        self.caches = ModelCaches(kv=kv, gdn=GDNCache([], []), layer_slot={i: i for i in range(num_layers)})
        self.blocks = IdPool(num_blocks, "mtp kv blocks")
        self.tables: dict[int, list[int]] = {}
        self.dropped: set[int] = set()  # sequences given up for lack of blocks, until released

    def _reserve(self, seq_id: int, length: int) -> list[int]:
        table = self.tables.setdefault(seq_id, [])
        table += self.blocks.take(max(0, math.ceil(length / self.block_size) - len(table)))
        return table

    def propose(self, batch: DraftBatch) -> DraftOutput:
        """Sequences this drafter cannot hold (its KV blocks ran out) are dropped: they get no drafts from then
        on, and the verifier decodes them without; nothing fails. A sequence first seen past position 0 has
        KV this drafter never built: it is reported missing (the verifier recomputes it)."""
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        served, rows, row, missing = [], [], 0, []
        for i, s in enumerate(batch.seqs):
            n = len(s.token_ids) - 1
            if s.start_pos > 0 and s.seq_id not in self.tables and s.seq_id not in self.dropped:
                missing.append(s.seq_id)
            elif s.seq_id not in self.dropped and self._try_reserve(s):
                served.append(i)
                rows.extend(range(row, row + n))
            row += n
        if served:
            hidden = batch.hidden[torch.tensor(rows, dtype=torch.long, device=batch.hidden.device)]
            for i, d in zip(served, self._draft([batch.seqs[i] for i in served], hidden)):
                drafts[i] = d
        return DraftOutput(drafts=drafts, missing=missing)

    def _try_reserve(self, s) -> bool:
        k = min(s.num_drafts, self.max_drafts)
        try:
            self._reserve(s.seq_id, s.start_pos + len(s.token_ids) - 1 + max(k - 1, 0))
            return True
        except PoolExhausted as e:
            log.warning("sequence %d dropped by the mtp drafter (%s): it decodes without drafts", s.seq_id, e)
            self.release([s.seq_id])
            self.dropped.add(s.seq_id)
            return False

    def _draft(self, seqs, hidden: torch.Tensor) -> list[list[int]]:
        ks = [min(s.num_drafts, self.max_drafts) for s in seqs]
        tables = [self.tables[s.seq_id] for s in seqs]
        # Catch-up: pairs (token at p + 1, target hidden at p) for the newly committed positions p.
        catch_up = ForwardBatch.build([s.token_ids[1:] for s in seqs], [s.start_pos for s in seqs], tables,
                                      self.block_size, [0] * len(seqs), device=self.device)
        out = self.head(catch_up, hidden, self.caches, layer=0)[catch_up.logits_indices]  # [B, H]
        drafts: list[list[int]] = [[] for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        next_pos = [s.start_pos + len(s.token_ids) - 1 for s in seqs]  # position of the next MTP input
        out = out[live]
        for step in range(max(ks, default=0)):
            tokens = self.head.logits(out).argmax(-1).tolist()  # draft step `step` for every live sequence
            for i, t in zip(live, tokens):
                drafts[i].append(t)
            keep = [n for n, i in enumerate(live) if ks[i] > step + 1]
            live, out = [live[n] for n in keep], out[keep]
            if not live:
                break
            feed = ForwardBatch.build([[drafts[i][-1]] for i in live], [next_pos[i] + step for i in live],
                                      [tables[i] for i in live], self.block_size, [0] * len(live),
                                      device=self.device)
            out = self.head(feed, out, self.caches, layer=(step + 1) % len(self.head.layers))
        return drafts

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.blocks.give_back(self.tables.pop(i, []))
            self.dropped.discard(i)

    def clear(self) -> None:
        self.release(list(self.tables))
