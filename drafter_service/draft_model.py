"""Draft-model drafter: a smaller model of a family our loader supports (Qwen3.5 dense / MoE, Qwen3-Next)
drafts k tokens greedily, with its own paged KV cache and its own Gated DeltaNet state.

Rollback to the accepted prefix, by recompute. Each sequence owns two GDN state slots:
    commit  — the state after exactly the committed tokens the drafter has run (`processed` of them)
    scratch — a copy of commit, advanced through this step's drafts and thrown away
Per step: (1) catch-up: the committed tokens not run yet (the accepted drafts, the recovered / bonus token;
a prompt chunk) run on the commit slot in one ragged forward; the last one's logits give draft 1;
(2) commit is copied to scratch (one state per GDN layer); (3) drafts 2..k run one token per forward on the
scratch slot. Draft tokens' KV rows sit past the committed length and are overwritten by later catch-ups
(attention at position p reads positions ≤ p only), so the KV cache needs no rollback. Accepted drafts are
recomputed in the next catch-up: at most k + 1 tokens per sequence, free on a bandwidth-bound GPU.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from specdec.drafting import DraftBatch, DraftInput, DraftOutput, ModelFacts
from specdec.id_pool import IdPool, PoolExhausted
from specdec.models.caches import ModelCaches
from specdec.models.forward_batch import ForwardBatch
from specdec.models.loader import LoadedModel
from specdec.transport.tensor_bytes import DTYPE_NAMES

log = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    pair: int                                          # commit slot = pair, scratch slot = pair + max_seqs
    context: list[int] = field(default_factory=list)   # committed tokens the verifier has sent
    processed: int = 0                                 # of which the commit slot and KV cache hold
    table: list[int] = field(default_factory=list)     # KV block ids


class DraftModelDrafter:
    kind = "draft_model"
    needs_hidden = False

    def __init__(self, loaded: LoadedModel, max_drafts: int, num_blocks: int = 4096, block_size: int = 16,
                 max_seqs: int = 64, prefill_chunk: int = 512, device: str | torch.device | None = None,
                 vocab_fingerprint: str = ""):
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.config, self.model = loaded.config, loaded.model
        self.max_drafts, self.block_size, self.max_seqs = max_drafts, block_size, max_seqs
        # the draft model's own device unless told (a CPU default beside CUDA weights fails at the first step)
        self.prefill_chunk = prefill_chunk
        self.device = torch.device(device) if device is not None else self.model.embed_tokens.weight.device
        dtype = self.model.embed_tokens.weight.dtype
        self.facts = ModelFacts(hidden_size=self.config.hidden_size, vocab_size=self.config.vocab_size,
                                dtype=DTYPE_NAMES[dtype], model_type=self.config.model_type,
                                vocab_fingerprint=vocab_fingerprint)
        self.caches = ModelCaches.allocate(self.config, num_blocks, block_size, 2 * max_seqs, max_drafts=0,
                                           dtype=dtype, device=self.device)
        self.blocks = IdPool(num_blocks, "draft-model kv blocks")
        self.pairs = IdPool(max_seqs, "draft-model state slots")
        self.seqs: dict[int, DraftSeq] = {}
        self.dropped: set[int] = set()  # given up for lack of blocks / slots, until released

    # ---- bookkeeping ---------------------------------------------------------------------
    def _ingest(self, s: DraftInput) -> DraftSeq | None:
        """Append s's tokens to the sequence's context; forget what no longer matches (a restarted sequence)."""
        seq = self.seqs.get(s.seq_id)
        if seq is None:
            if s.start_pos != 0:
                return None  # context we never saw: the verifier must re-send it (DraftOutput.missing)
            seq = self.seqs[s.seq_id] = DraftSeq(pair=self.pairs.take()[0])
            self._reset(seq)
        if s.start_pos > len(seq.context):
            self.release([s.seq_id])
            return None
        end = min(seq.processed, s.start_pos + len(s.token_ids))
        if seq.context[s.start_pos:end] != s.token_ids[:max(0, end - s.start_pos)]:
            self._reset(seq)  # the committed past changed: recompute from position 0
        del seq.context[s.start_pos:]
        seq.context += s.token_ids
        return seq

    def _reset(self, seq: DraftSeq) -> None:
        seq.processed = 0
        self.caches.gdn.reset(seq.pair)

    def _reserve(self, seq: DraftSeq, length: int) -> None:
        seq.table += self.blocks.take(max(0, math.ceil(length / self.block_size) - len(seq.table)))

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            seq = self.seqs.pop(i, None)
            if seq is not None:
                self.blocks.give_back(seq.table)
                self.pairs.give_back([seq.pair])
            self.dropped.discard(i)

    def clear(self) -> None:
        self.release(list(self.seqs) + list(self.dropped))

    # ---- one step ------------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> DraftOutput:
        drafts: list[list[int]] = [[] for _ in batch.seqs]
        missing, work = [], []  # work: (index in batch, seq, catch-up chunk, k)
        for i, s in enumerate(batch.seqs):
            if s.seq_id in self.dropped:
                continue
            try:
                seq = self._ingest(s)
                if seq is None:
                    missing.append(s.seq_id)
                    continue
                chunk = seq.context[seq.processed:seq.processed + self.prefill_chunk]
                k = min(s.num_drafts, self.max_drafts) if seq.processed + len(chunk) == len(seq.context) else 0
                self._reserve(seq, seq.processed + len(chunk) + max(k - 1, 0))
            except PoolExhausted as e:
                log.warning("sequence %d dropped by the draft model (%s): it decodes without drafts", s.seq_id, e)
                self.release([s.seq_id])
                self.dropped.add(s.seq_id)
                continue
            if chunk:
                work.append((i, seq, chunk, k))
        if work:
            for i, d in zip([w[0] for w in work], self._run(work)):
                drafts[i] = d
        return DraftOutput(drafts=drafts, missing=missing)

    def _forward(self, chunks: list[list[int]], starts: list[int], seqs: list[DraftSeq],
                 slot_offset: int) -> torch.Tensor:
        batch = ForwardBatch.build(chunks, starts, [s.table for s in seqs], self.block_size,
                                   [s.pair + slot_offset for s in seqs], device=self.device)
        _, logits = self.model(batch, self.caches)  # [B, V] the last token of each chunk
        return logits

    def _run(self, work) -> list[list[int]]:
        seqs = [w[1] for w in work]
        ks = [w[3] for w in work]
        logits = self._forward([w[2] for w in work], [s.processed for s in seqs], seqs, 0)  # catch-up
        for seq, (_, _, chunk, _) in zip(seqs, work):
            seq.processed += len(chunk)
        drafts: list[list[int]] = [[] for _ in work]
        live = [n for n, k in enumerate(ks) if k > 0]
        if not live:
            return drafts
        tokens = logits[live].argmax(-1).tolist()                   # draft 1 of every live sequence
        self._copy_state([seqs[n].pair for n in live], self.max_seqs)  # commit -> scratch
        for step in range(1, max(ks)):
            for n, t in zip(live, tokens):
                drafts[n].append(t)
            live = [n for n in live if ks[n] > step]
            tokens = self._forward([[drafts[n][-1]] for n in live], [len(seqs[n].context) + step - 1 for n in live],
                                   [seqs[n] for n in live], self.max_seqs).argmax(-1).tolist()
        for n, t in zip(live, tokens):
            drafts[n].append(t)
        return drafts

    def _copy_state(self, pairs: list[int], offset: int) -> None:
        """GDN state (recurrent + conv window) of slots `pairs` into slots `pairs + offset`, every layer."""
        src = torch.tensor(pairs, dtype=torch.long, device=self.device)
        dst = src + offset
        for recurrent, conv in zip(self.caches.gdn.recurrent, self.caches.gdn.conv):
            recurrent[dst] = recurrent[src]  # [n, HV, K, V] (no pending drafts: this model steps with d = 0)
            conv[dst] = conv[src]            # [n, C, W - 1]
