"""The speculative decoding engine: one step = schedule → target forward over [last, drafts] (ragged) →
rejection sampling → commit (KV by position, GDN state slot by accepted count) → stop checks → drafter
ingests what was committed and proposes the next drafts (DESIGN §3)."""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field

import torch

from drafter_service.drafter import DraftBatch, DraftInput, Drafter
from specdec.sampling_params import SamplingParams

from .acceptance_stats import AcceptanceStats
from .forced_acceptance import ForcedAcceptance
from .model_runner import ModelRunner
from .rejection_sampler import SamplingBatch, rejection_sample
from .scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_drafts: int = 3                        # k; 0 = plain decoding
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    forced_acceptance: ForcedAcceptance | None = None  # benchmarks only, see ForcedAcceptance


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None               # None while running
    stats: AcceptanceStats
    num_prompt: int
    forced_acceptance: bool = False


class SpecEngine:
    def __init__(self, runner: ModelRunner, drafter: Drafter | None, config: EngineConfig):
        self.runner, self.drafter, self.config = runner, drafter, config
        self.scheduler = Scheduler(runner, config.scheduler)
        self.stats = AcceptanceStats()
        self.step_count = 0
        self._ids = itertools.count()
        self._seeds = random.Random()
        self.by_request: dict[str, Sequence] = {}
        self.eos = set(runner.config.eos_token_id)
        self.max_len = runner.blocks.size * runner.block_size

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.runner.config.vocab_size
        params.validate(vocab)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request_id in self.by_request:
            raise ValueError(f"request id {request_id!r} is already running")
        if len(prompt_ids) + params.max_tokens + self.config.num_drafts > self.max_len:
            raise OverflowError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                                f"cache capacity of {self.max_len} tokens")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        seq = Sequence(next(self._ids), list(prompt_ids), len(prompt_ids), params, seed, request_id)
        self.by_request[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.by_request.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = "abort"
        if self.drafter is not None:
            self.drafter.release([seq.seq_id])
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if self.drafter is not None and self.scheduler.preempted:
            self.drafter.release([s.seq_id for s in self.scheduler.preempted])
        if not plan:
            return []
        self.step_count += 1
        seqs = [p.seq for p in plan]
        hidden, logits = self.runner.forward(seqs, [p.chunk for p in plan], [p.num_drafts for p in plan],
                                             logits=[p.num_drafts + 1 if p.samples else 0 for p in plan])
        sampled = [p for p in plan if p.samples]
        verdict = self._verify(sampled, logits) if sampled else None
        tokens_of = {id(p): t for p, t in zip(sampled, verdict.tokens)} if verdict else {}
        accepted_of = {id(p): j for p, j in zip(sampled, verdict.num_accepted)} if verdict else {}
        outputs, committed = [], []
        for p in plan:
            seq, old_cached = p.seq, p.seq.num_cached
            j = accepted_of.get(id(p), 0)
            seq.num_cached += len(p.chunk) - p.num_drafts + j
            seq.gdn_read_offset = j
            committed.append((p, old_cached))
            if id(p) in tokens_of:
                outputs.append(self._commit_tokens(p, tokens_of[id(p)], j))
        self._draft(committed, hidden)
        return outputs

    def _verify(self, sampled: list[ScheduledSeq], logits: torch.Tensor):
        device = logits.device
        params = [p.seq.params for p in sampled]
        sampling = SamplingBatch(
            greedy=torch.tensor([q.greedy for q in params], device=device),
            temperature=torch.tensor([q.temperature if not q.greedy else 1.0 for q in params], device=device),
            top_k=torch.tensor([q.top_k for q in params], device=device),
            top_p=torch.tensor([q.top_p for q in params], device=device),
            seeds=torch.tensor([p.seq.seed for p in sampled], device=device),
            offsets=torch.tensor([len(p.seq.output_ids) for p in sampled], device=device))
        drafts = torch.tensor([t for p in sampled for t in p.chunk[len(p.chunk) - p.num_drafts:]],
                              dtype=torch.long, device=device)
        forced = self.config.forced_acceptance
        forced_accepts = forced.draw([p.seq.seq_id for p in sampled]) if forced else None
        return rejection_sample(logits, drafts, [p.num_drafts for p in sampled], sampling,
                                forced_accepts=forced_accepts)

    def _commit_tokens(self, p: ScheduledSeq, tokens: list[int], num_accepted: int) -> RequestOutput:
        seq = p.seq
        kept, reason = [], None
        for t in tokens:
            kept.append(t)
            if (t in self.eos and not seq.params.ignore_eos) or t in seq.params.stop_token_ids:
                reason = "stop"
                break
            if len(seq.output_ids) + len(kept) >= seq.params.max_tokens:
                reason = "length"
                break
        seq.token_ids += kept
        if p.decoding:  # a verify step (the step that completes a prefill is not one)
            seq.stats.record(p.num_drafts, num_accepted, len(kept))
            self.stats.record(p.num_drafts, num_accepted, len(kept))
        if reason:
            self._finish(seq, reason)
        return RequestOutput(seq.request_id, kept, reason, seq.stats, seq.num_prompt,
                             forced_acceptance=self.config.forced_acceptance is not None)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.by_request.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.release([seq.seq_id])

    def _draft(self, committed: list[tuple[ScheduledSeq, int]], hidden: torch.Tensor) -> None:
        """Send the drafter what each live sequence committed this step; keep its proposals for the next."""
        k = self.config.num_drafts
        inputs, live, rows, first_row = [], [], [], 0
        for p, old in committed:
            seq = p.seq
            if seq.finish_reason is None:
                seq.drafts = []
                want = min(k, seq.remaining - 1) if seq.is_decoding else 0
                inputs.append(DraftInput(seq.seq_id, old, seq.token_ids[old:seq.num_cached + 1], max(0, want)))
                live.append(p)
                rows.extend(range(first_row, first_row + seq.num_cached - old))  # hidden of committed tokens
            first_row += len(p.chunk)
        if self.drafter is None or k == 0 or not live:
            return
        rows_t = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        batch = DraftBatch(self.step_count, inputs, hidden[rows_t] if self.drafter.needs_hidden else None)
        out = self.drafter.propose(batch)
        for p, drafts, inp in zip(live, out.drafts, inputs):
            p.seq.drafts = list(drafts[:inp.num_drafts])

    # ---- convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (all added at once); returns each completion's token ids."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, prompt, sp in zip(ids, prompts, params):
            self.add_request(rid, prompt, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work:
            for o in self.step():
                out[o.request_id] += o.new_token_ids
        return [out[rid] for rid in ids]
