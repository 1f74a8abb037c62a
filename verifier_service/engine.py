"""The speculative decoding engine: one step = schedule → target forward over [last, drafts] (ragged) →
rejection sampling → commit (KV by position, GDN drafts replayed by accepted count) → stop checks → drafter
ingests what was committed and proposes the next drafts (docs/sampling.md).

A drafter that answers later (the remote link) is asked at the end of step n and its answer read at the start
of step n + 1: the step's tokens go out to the clients while the drafter drafts.

When no request counts penalties or asks for logprobs, and drafts (if any) are made on the device, steps overlap:
step n + 1 is launched before step n's tokens are read (overlapped_steps.py, in_flight.py), so step() returns the
outputs of the step launched by the call before it."""
from __future__ import annotations

import itertools
import time
import logging
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kernels.sampling import cu_rows_of
from specdec.drafting import AnswersLater, DraftBatch, DraftInput, DraftOutput, Drafter, proposal_problem
from specdec.models.batch_staging import concat_ranges
from specdec.models.pinned_upload import PinnedUpload
from specdec.sampling_params import SamplingParams
from specdec.step_trace import OFF, StepTrace

from .acceptance_stats import AcceptanceStats
from .forced_acceptance import ForcedAcceptance
from .hidden_staging import HiddenStaging
from .in_flight import InFlightStep
from .overlapped_steps import OverlappedSteps
from .model_runner import ModelRunner
from .rejection_sampler import greedy_verdict, rejection_sample
from .sampling_batch import SamplingBatch, draft_probs_rows
from .scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_drafts: int = 3                        # k; 0 = plain decoding
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    forced_acceptance: ForcedAcceptance | None = None  # benchmarks only, see ForcedAcceptance
    max_context: int = 0                       # prompt + completion limit; 0: what the KV cache holds
    overlap: bool = True                       # launch a draft-free step before reading the last one's tokens


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None               # None while running
    stats: AcceptanceStats
    num_prompt: int
    forced_acceptance: bool = False
    logprobs: list | None = None            # [len(new_token_ids)] TokenLogprob when the request asked
    queue_seconds: float = 0.0              # the request's wait before its first admission


@dataclass
class PendingDrafts:
    """Drafts asked for at the end of one step, read at the start of the next."""
    answer: Callable[[], DraftOutput]
    batch: DraftBatch
    seqs: list[Sequence]          # batch.seqs's sequences, in order


class SpecEngine(OverlappedSteps):
    def __init__(self, runner: ModelRunner, drafter: Drafter | None, config: EngineConfig, trace: StepTrace = OFF):
        self.runner, self.drafter, self.config, self.trace = runner, drafter, config, trace
        self.scheduler = Scheduler(runner, config.scheduler)
        self.stats = AcceptanceStats()
        self.step_count = 0
        self.last_step_seconds: dict[str, float] = {}
        self.drafter_fallback_steps = 0
        self.overlapped_draft_steps = 0          # steps that verified drafts, launched before the last one was read
        self._last_drafter_failure = ""
        self._context_lost: set[int] = set()  # seq ids whose context the drafter reported missing
        self._pending: PendingDrafts | None = None   # drafts asked for and not yet read
        self._staging: HiddenStaging | None = None   # the drafter's hidden rows, placed before the sync
        self._drafter_seconds, self._drafter_compute = 0.0, None  # this step's, for last_step_seconds
        self._ids = itertools.count()
        self._seeds = random.Random()
        self.by_request: dict[str, Sequence] = {}
        self.eos = set(runner.config.eos_token_id)
        # pinned host → device copies of what a step uploads: no wait for the device before the sampler's sync
        self._upload_drafts, self._upload_forced, self._upload_rows = (PinnedUpload(runner.device) for _ in range(3))
        self._upload_sampling = (PinnedUpload(runner.device), PinnedUpload(runner.device))
        self._upload_fill = PinnedUpload(runner.device)
        self._in_flight: InFlightStep | None = None   # an overlapped step launched and not read yet
        capacity = runner.blocks.size * runner.block_size
        self.max_len = min(config.max_context, capacity) if config.max_context else capacity

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.runner.config.vocab_size
        params.validate(vocab)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request_id in self.by_request:
            raise ValueError(f"request_id {request_id!r} is already running: request ids must be unique")
        # Drafts never reach past prompt + max_tokens (a sequence asks for at most remaining - 1 of them), so
        # the limit is the same as the gateway's: no request passes there and fails here.
        if len(prompt_ids) + params.max_tokens > self.max_len:
            raise OverflowError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                                f"maximum context of {self.max_len} tokens")
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
    def overlapping(self) -> bool:
        """A launched step is not read yet: the last step() overlapped with the GPU's work."""
        return self._in_flight is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # ---- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.trace.mark("step.begin")
        if self._overlaps():
            return self._overlapped_step()
        if self._in_flight is not None:   # the steps overlapped until now: read the last one before going on
            previous, self._in_flight = self._in_flight, None
            outputs = self._finish_in_flight(previous)
            self.trace.mark("step.end")
            return outputs
        self._collect_drafts()
        plan = self.scheduler.schedule()
        if self.drafter is not None and self.scheduler.preempted:
            self.drafter.release([s.seq_id for s in self.scheduler.preempted])
        if not plan:
            return []
        self.step_count += 1
        seqs = [p.seq for p in plan]
        self.trace.mark("forward.begin", batch=len(plan))
        t0 = time.perf_counter()
        hidden, logits = self.runner.forward(seqs, [p.chunk for p in plan], [p.num_drafts for p in plan],
                                             logits=[p.num_drafts + 1 if p.samples else 0 for p in plan])
        t1 = time.perf_counter()
        self.trace.mark("forward.launched")
        sampled = [p for p in plan if p.samples]
        stage = self._stage_hidden(plan, hidden)
        verdict = self._verify(sampled, logits, stage) if sampled else None
        if stage is not None and verdict is None:
            stage(None)   # no sampling, no sync: every row of a prefill chunk is committed
        t2 = time.perf_counter()
        self.trace.mark("verified")
        tokens_of = {id(p): t for p, t in zip(sampled, verdict.tokens)} if verdict else {}
        accepted_of = {id(p): j for p, j in zip(sampled, verdict.num_accepted)} if verdict else {}
        logprobs_of = {id(p): lp for p, lp in zip(sampled, verdict.logprobs)} if verdict else {}
        outputs, committed = [], []
        for p in plan:
            seq, old_cached = p.seq, p.seq.num_cached
            j = accepted_of.get(id(p), 0)
            seq.num_cached += len(p.chunk) - p.num_drafts + j
            seq.gdn_read_offset = j
            seq.verify_launches += p.decoding
            committed.append((p, old_cached))
            if id(p) in tokens_of:
                outputs.append(self._commit_tokens(p, tokens_of[id(p)], j, logprobs_of[id(p)]))
        self.trace.mark("committed")
        self._draft(committed, hidden)
        # Host time per phase; on a GPU the target's kernels finish inside "verify" (its one sync per step).
        # "drafter": the host time spent asking for drafts and reading them (for a drafter that answers later,
        # the wait at the start of this step for the last one's answer); what ran in between is not in it.
        self.last_step_seconds = {"target": t1 - t0, "verify": t2 - t1, "drafter": self._drafter_seconds}
        if self._drafter_compute is not None:  # what the drafter itself spent (a remote one reports it)
            self.last_step_seconds["drafter_compute"] = self._drafter_compute
        self._drafter_seconds, self._drafter_compute = 0.0, None
        self.trace.mark("step.end")
        return outputs

    # ---- synchronous steps (penalties, logprobs, drafts made on the host) ---------------------------------
    def _stage_hidden(self, plan: list[ScheduledSeq], hidden: torch.Tensor):
        """Lay out this step's hidden rows for a drafter that takes them; returns what places them once the
        accepted counts are on the device (before the sync), or None."""
        if self._staging is not None:
            self._staging.staged = False
        drafter = self.drafter
        if drafter is None or self.num_drafts == 0 or not drafter.needs_hidden:
            return None
        rows = hidden.shape[0]
        if self._staging is None or self._staging.max_rows < rows or self._staging.buffer.dtype != hidden.dtype:
            size = max(rows, self.config.scheduler.max_batched_tokens)
            self._staging = HiddenStaging(size, hidden.shape[1], hidden.dtype, hidden.device)
        staging = self._staging
        staging.plan([len(p.chunk) for p in plan], [p.num_drafts for p in plan],
                     [i for i, p in enumerate(plan) if p.samples])
        return lambda accepted: staging.gather(hidden, accepted)

    def _verify(self, sampled: list[ScheduledSeq], logits: torch.Tensor, before_sync=None):
        b, width = len(sampled), max(p.num_drafts for p in sampled)
        num_drafts = np.fromiter((p.num_drafts for p in sampled), np.int64, count=b)
        drafts = np.full((b, width), -1, np.int64)
        for row, p in zip(drafts, sampled):
            row[:p.num_drafts] = p.chunk[len(p.chunk) - p.num_drafts:]
        flat = self._upload_drafts(np.concatenate([num_drafts, cu_rows_of(num_drafts), drafts.ravel()]))
        num_drafts_dev, cu_rows, drafts_dev = flat[:b], flat[b:2 * b + 1], flat[2 * b + 1:].view(b, width)
        counts = self._forced_counts(sampled)
        forced_accepts = None if counts is None else self._upload_forced(np.asarray(counts, np.int64))
        if all(p.seq.params.argmax_only for p in sampled):  # no sampling state, no draws
            return greedy_verdict(logits, drafts_dev, num_drafts_dev, cu_rows, forced_accepts, before_sync)
        uses_q = [p.seq.draft_probs is not None and p.num_drafts > 0 and not p.seq.params.greedy for p in sampled]
        sampling = SamplingBatch.of([p.seq for p in sampled], uses_q, logits.shape[-1], self._upload_sampling)
        return rejection_sample(logits, drafts_dev, num_drafts_dev, sampling, draft_probs_rows(sampled, uses_q, logits),
                                forced_accepts, before_sync)

    def _forced_counts(self, sampled: list[ScheduledSeq]) -> list[int] | None:
        """Forced acceptance (benchmarks): each verify step's count, keyed by the request's seed and how many
        verify steps it launched before, so every path draws the same schedule."""
        forced = self.config.forced_acceptance
        if not forced:
            return None
        return forced.draw([(p.seq.seed, p.seq.verify_launches) for p in sampled])

    def _commit_tokens(self, p: ScheduledSeq, tokens: list[int], num_accepted: int,
                       logprobs: list | None) -> RequestOutput:
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
        seq.append_output(kept)
        if p.decoding:  # a verify step (the step that completes a prefill is not one)
            seq.stats.record(p.num_drafts, num_accepted, len(kept))
            self.stats.record(p.num_drafts, num_accepted, len(kept))
        if reason:
            self._finish(seq, reason)
        return RequestOutput(seq.request_id, kept, reason, seq.stats, seq.num_prompt,
                             forced_acceptance=self.config.forced_acceptance is not None,
                             logprobs=logprobs[:len(kept)] if logprobs is not None else None,
                             queue_seconds=seq.queue_seconds or 0.0)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.by_request.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.release([seq.seq_id])

    def _draft(self, committed: list[tuple[ScheduledSeq, int]], hidden: torch.Tensor) -> None:
        """Send the drafter what each live sequence committed this step; its proposals are for the next (read
        now from an in-process drafter, at the start of the next step from one that answers later).

        A drafter that lacks a sequence's earlier context (it reconnected, or is a new process after a swap)
        says so in DraftOutput.missing; the next step re-sends that context: all its tokens to a token-only
        drafter, and for one that needs hidden states the sequence is recomputed (preempted), so that the
        drafter receives every hidden state again as the prefill runs. Either way it drafts again soon."""
        drafter, k = self.drafter, self.num_drafts
        if drafter is not None and k == 0 and self.config.num_drafts > 0:
            self._drafter_failed("the drafter is not connected")  # this step decodes without drafts
        inputs, live, row_starts, row_counts, first_row, rebuild = [], [], [], [], 0, []
        for p, old in committed:
            seq = p.seq
            if seq.finish_reason is None:
                seq.drafts, seq.draft_probs = [], None
                item = self._draft_input(seq, old, k)
                if item is None and k > 0 and seq.seq_id in self._context_lost:
                    rebuild.append(seq)
                elif item is not None:
                    inputs.append(item)
                    live.append(seq)
                    if item.start_pos == old:  # the committed tokens' hidden rows
                        row_starts.append(first_row)
                        row_counts.append(seq.num_cached - old)
            first_row += len(p.chunk)
        self._recompute_for_drafter(rebuild)
        if drafter is None or k == 0 or not live:
            return
        rows = None
        if drafter.needs_hidden:  # every sequence's committed rows in batch order: staged before the sync
            staged = self._staging is not None and self._staging.staged and len(row_starts) == len(committed)
            rows = self._staging.rows(sum(row_counts)) if staged else \
                hidden[self._upload_rows(concat_ranges(row_starts, row_counts))]
        self.trace.mark("draft.inputs")
        start = time.perf_counter()
        batch = DraftBatch(self.step_count, inputs, rows)
        later = isinstance(drafter, AnswersLater)
        answer = self._send(drafter, batch) if later else (lambda: drafter.propose(batch))
        self._pending = PendingDrafts(answer, batch, live)
        self._drafter_seconds += time.perf_counter() - start
        if not later:  # an in-process drafter answers now
            self._collect_drafts()

    def _send(self, drafter: AnswersLater, batch: DraftBatch) -> Callable[[], DraftOutput]:
        """Ask a drafter that answers later; a send that raises is a failed answer."""
        try:
            return drafter.propose_later(batch)
        except Exception as e:  # a drafter's bug must not take the verifier down
            out = self._raised(e, batch)
            return lambda: out

    def _raised(self, error: Exception, batch: DraftBatch) -> DraftOutput:
        kind = getattr(self.drafter, "kind", "(detached)")  # an answer read after the drafter was detached
        log.exception("drafter %s raised; this step decodes without drafts", kind, exc_info=error)
        return DraftOutput.failed(len(batch.seqs), f"{type(error).__name__}: {error}")

    def _collect_drafts(self) -> None:
        """Read the pending answer (if any) into its sequences' drafts."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        start = time.perf_counter()
        try:
            out = pending.answer()
        except Exception as e:  # a drafter's bug must not take the verifier down
            out = self._raised(e, pending.batch)
        out = self._checked(out, pending.batch)
        self._drafter_seconds += time.perf_counter() - start
        self._drafter_compute = out.compute_seconds
        self._context_lost.update(out.missing)
        if self._context_lost:
            self._context_lost &= {s.seq_id for s in self.scheduler.running}
        start = 0
        for seq, drafts in zip(pending.seqs, out.drafts):  # a sequence that ended meanwhile leaves them unused
            seq.drafts = list(drafts)
            if out.probs is not None:
                seq.draft_probs = out.probs[start:start + len(seq.drafts)]
            start += len(drafts)

    def _checked(self, out: DraftOutput, batch: DraftBatch) -> DraftOutput:
        """A failed, broken or malformed answer is a drafter failure for this step (no drafts for anyone:
        k = 0), logged, never an error for a request."""
        problem = out.failure or proposal_problem(out, batch.seqs, self.runner.config.vocab_size)
        if problem:
            self._drafter_failed(problem)
            return DraftOutput.failed(len(batch.seqs), problem)
        return out

    def _drafter_failed(self, reason: str) -> None:
        self.drafter_fallback_steps += 1
        if reason != self._last_drafter_failure or self.drafter_fallback_steps % 100 == 0:
            log.warning("drafter failure (%d steps so far without drafts): %s", self.drafter_fallback_steps, reason)
            self._last_drafter_failure = reason

    def _recompute_for_drafter(self, seqs: list[Sequence]) -> None:
        """Preempt `seqs` by recompute: they prefill again, and the drafter sees all their hidden states."""
        for seq in reversed(seqs):
            self._context_lost.discard(seq.seq_id)
            self.scheduler.preempt(seq, "the drafter lost its hidden states")

    def _draft_input(self, seq: Sequence, old: int, k: int) -> DraftInput | None:
        """What the drafter gets for `seq` this step: the tokens committed since `old` (the whole context if the
        drafter lost it and can take tokens alone), or None (no drafter, or a recompute is needed first)."""
        if self.drafter is None or k == 0:
            return None
        want = max(0, min(k, seq.remaining - 1)) if seq.is_decoding else 0
        if seq.seq_id in self._context_lost and old > 0:
            if self.drafter.needs_hidden:
                return None
            self._context_lost.discard(seq.seq_id)
            return DraftInput(seq.seq_id, 0, seq.token_ids[:seq.num_cached + 1], want)
        self._context_lost.discard(seq.seq_id)
        return DraftInput(seq.seq_id, old, seq.token_ids[old:seq.num_cached + 1], want)

    @property
    def fallback_steps(self) -> int:
        """Steps decoded with k = 0 although a drafter is configured: it was away, or its step failed."""
        return self.drafter_fallback_steps

    @property
    def num_drafts(self) -> int:
        """k for this step: the configured k, capped by what the drafter can do (0 while it is away)."""
        if self.drafter is None:
            return 0
        return min(self.config.num_drafts, self.drafter.max_drafts)

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

