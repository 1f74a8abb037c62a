"""The speculative decoding engine. One step, top to bottom:

    schedule   which sequences run, with which tokens (scheduler.py): decoders verify [last token, drafts...],
               prompts prefill a chunk
    launch     the target's forward over them (executor.py), then the verdict on the device (verify_stage.py,
               sampler/): accepted drafts and each sampled sequence's emitted token; the drafter is asked on the
               device when it drafts there (drafting_stage.py); nothing is read back yet
    read       the verdict on the host: the step's one sync (in_flight.py)
    commit     accepted drafts join each sequence's cache, emitted tokens its output up to its stop (requests.py,
               which also admits and ends requests); a drafter that needs the tokens on the host is asked now for
               the next step's drafts

When no request counts penalties or asks for logprobs, and drafts (if any) are made on the device, steps overlap:
step n + 1 is launched before step n is read, its inputs written on the device from step n's unread verdict
(in_flight.py, ChainedInputs), so step() returns the outputs of the step launched by the call before it and the
host's work between two steps runs while the GPU computes. Otherwise a step is read right after its launch. Both
are the same path; only which step is read differs. Grammar-constrained requests overlap without drafts: their
masks need step n's tokens, so step n is read after step n + 1's forward is queued and before its verdict.

A sequence's state changes only through its own methods (sequence.py): here at launch and at read; in the requests,
the scheduler, the block manager and the drafting stage at their own moments.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain

from specdec.drafting import Drafter
from specdec.grammar import Grammars
from specdec.models.pinned_upload import PinnedUpload
from specdec.sampling_params import SamplingParams
from specdec.step_trace import OFF, PhaseClock, StepTrace

from .acceptance_stats import AcceptanceStats
from .draft_policy import DraftPolicy
from .drafting_stage import DraftingStage
from .executor import Executor
from .forced_acceptance import ForcedAcceptance
from .in_flight import ChainedInputs, InFlightStep, LaunchedStep
from .requests import RequestOutput, Requests
from .scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from .sequence import Sequence
from .verify_stage import VerifyStage


@dataclass(frozen=True)
class EngineConfig:
    num_drafts: int = 3                        # k; 0 = plain decoding
    adaptive_drafts: bool = False              # each step verifies the k in 0..num_drafts of draft_policy.py
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    forced_acceptance: ForcedAcceptance | None = None  # benchmarks only, see ForcedAcceptance
    max_context: int = 0                       # prompt + completion limit; 0: what the KV cache holds
    overlap: bool = True                       # launch a step before reading the last one's tokens


class SpecEngine:
    def __init__(self, executor: Executor, drafter: Drafter | None, config: EngineConfig, trace: StepTrace = OFF,
                 grammars: Grammars | None = None):
        self.executor, self.config = executor, config
        device = executor.device
        self.scheduler = Scheduler(executor.blocks, config.scheduler)
        self.drafting = DraftingStage(drafter, config.num_drafts, executor.config.vocab_size,
                                      config.scheduler.max_batched_tokens, PinnedUpload(device),
                                      block_size=executor.block_size, trace=trace)
        self.stats = AcceptanceStats()
        self.policy = DraftPolicy(config.num_drafts, config.adaptive_drafts)   # its costs: warm_up.py
        self.drafting.step_drafts = config.num_drafts
        self.step_count = 0
        self.last_step_seconds: dict[str, float] = {}
        self.overlapped_draft_steps = 0          # steps that verified drafts, launched before the last one was read
        self.verifying = VerifyStage(device, grammars, config.forced_acceptance)
        self._upload_fill = PinnedUpload(device)   # an overlapped step's inputs from the unread one (ChainedInputs)
        self._in_flight: LaunchedStep | None = None   # an overlapped step launched and not read yet
        capacity = executor.blocks.kv_blocks.size * executor.block_size
        self.requests = Requests(self.scheduler, self.drafting, grammars, executor.config.vocab_size,
                                 set(executor.config.eos_token_id),
                                 min(config.max_context, capacity) if config.max_context else capacity,
                                 config.num_drafts > 0, config.forced_acceptance is not None)

    # ---- requests (requests.py) ---------------------------------------------------------
    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if any: from any thread (Requests.check_grammar)."""
        self.requests.check_grammar(params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.requests.add(request_id, prompt_ids, params)

    def abort(self, request_id: str) -> bool:
        return self.requests.abort(request_id)

    @property
    def by_request(self) -> dict[str, Sequence]:
        return self.requests.by_id

    @property
    def max_len(self) -> int:
        """The longest prompt + max_tokens a request may ask for."""
        return self.requests.max_len

    @property
    def trace(self) -> StepTrace:
        return self.drafting.trace

    @property
    def drafter(self) -> Drafter | None:
        return self.drafting.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.drafting.drafter = drafter

    @property
    def num_drafts(self) -> int:
        """k for this step: the configured k, capped by what the drafter can do (0 while it is away)."""
        return self.drafting.k

    @property
    def fallback_steps(self) -> int:
        """Steps decoded with k = 0 although a drafter is configured: it was away, or its step failed."""
        return self.drafting.fallback_steps

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
        if self.drafting.context_lost:
            self.drafting.prune_lost({s.seq_id for s in self.scheduler.running})
        overlap = self._overlaps()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not overlap:   # leaving overlapped steps: read the last one before going on
            outputs = self._read(previous)
            self.trace.mark("step.end")
            return outputs
        self.drafting.collect()               # a drafter service's answer to the last step read
        if previous is not None:
            self._settle(previous)            # its drafts, which this step's sequences verify
        schedule = self.scheduler.schedule(self._choose_drafts())  # a sequence whose last step is unread
        self.drafting.forget(schedule.preempted)
        # host time per phase: "target" queueing the step, "verify" reading and committing one (its one sync, where a
        # GPU's kernels finish), "drafter" asking the drafter and reading its answers (taken out of the other two)
        clock = PhaseClock(lambda: self.drafting.seconds)
        with clock.phase("target"):
            launched = self._launch(schedule.entries, previous, overlap) if schedule.entries else None
        to_read, self._in_flight = (previous, launched) if overlap else (launched, None)
        read_early = launched.read_early if launched is not None else None    # (between its forward and verdict)
        if read_early is not None:
            clock.move(launched.read_early_seconds, "target", "verify")
            to_read = None
        with clock.phase("verify"):
            outputs = (read_early or []) + (self._read(to_read) if to_read is not None else [])
        self.last_step_seconds = {**clock.seconds, "drafter": self.drafting.seconds}
        if self.drafting.compute_seconds is not None:  # what the drafter itself spent (a remote one reports it)
            self.last_step_seconds["drafter_compute"] = self.drafting.compute_seconds
        self.drafting.seconds, self.drafting.compute_seconds = 0.0, None
        self.trace.mark("step.end")
        return outputs

    def _choose_drafts(self) -> int:
        """This step's k (draft_policy.py), from the decoding sequences: what they verify now and what the drafter
        is asked for, for the next step. Sequences the policy gives up on leave the drafter here."""
        k, drafter, sched = self.drafting.k, self.drafter, self.scheduler
        # (a drafter that takes hidden states keeps its own part of prefix checkpoints: block_manager.py)
        self.executor.blocks.drafter_keeps_prefixes = drafter is not None and drafter.needs_hidden
        if k == 0:   # no drafter, or it is away (asked as before, so that its fallback steps are counted)
            return 0
        if not any(s.in_drafter for s in chain(sched.running, sched.waiting)):
            k = 0    # nobody to draft for (a drafter of host tokens is then skipped: the steps overlap)
        elif decoding := [s for s in sched.running if s.is_decoding]:
            in_drafter = [s for s in decoding if s.in_drafter]
            # a step asking a drafter of host tokens is synchronous whoever is in it, and a verify step replayed
            # from a CUDA graph pads every sequence to 1 + k tokens: priced whole
            proportional = (self.drafting.drafts_on_device or drafter.needs_hidden) and not self.executor.pads_batches
            # prompts wait while more of their tokens are left than one step's budget (a burst being admitted, a
            # long prompt's chunks); the decoders' own tokens are not counted (draft_policy.py)
            choice = self.policy.choose([s.stats for s in in_drafter], self.stats, len(decoding) - len(in_drafter),
                                        proportional=proportional,
                                        prompts_waiting=sched.prompt_tokens_left > sched.config.max_batched_tokens)
            leaving = [in_drafter[i] for i in choice.leaving]
            self.drafting.forget(leaving)
            for seq in leaving:
                seq.left_drafter()
            k = min(k, choice.k)
        self.drafting.step_drafts = k
        return k

    def _overlaps(self) -> bool:
        """Can this step be launched before the last one's tokens are read? When no request has penalties or
        logprobs (they need the host's tokens each step) and drafts, if any, are made on the device from the unread
        verdict (an in-process MTP head, an MTP drafter service through device steps) or none are asked for (a
        drafter of host tokens skipped at k = 0). A drafter of host tokens (n-gram, a remote service) or one that
        lost context runs synchronous steps, and so do grammar-constrained requests with drafts (their masks walk
        the drafts on the host; without drafts they overlap, reading the last step early: _launch)."""
        if not self.config.overlap or self.drafting.context_lost:
            return False
        drafting = self.config.num_drafts > 0 and self.drafter is not None
        if drafting and not self.drafting.drafts_on_device and not self.drafting.skips_drafter:
            return False
        sched = self.scheduler
        # a grammar's masks follow the host's tokens: without drafts the step reads the last one early (_launch)
        return all(s.params.decided_on_device or (not drafting and not s.params.penalised
                                                  and s.params.logprobs is None)
                   for s in chain(sched.running, sched.waiting))

    def _launch(self, entries: list[ScheduledSeq], previous: LaunchedStep | None, overlap: bool) -> LaunchedStep:
        """Queue the step's forward and its verdict (and, overlapped, the drafter's next drafts on the device);
        the sequences' caches advance by what the host knows (the accepted drafts follow at the read). A
        constrained step launched over an unread one reads that one between its forward and its verdict (its
        outputs in read_early): the grammar masks follow the tokens it emits, and the host reads them while the
        device runs the forward."""
        self.step_count += 1
        self.overlapped_draft_steps += overlap and any(p.num_drafts for p in entries)
        sampled = [p for p in entries if p.samples]            # before the counts below move
        forced = self.verifying.forced_counts(sampled)
        unread = previous.verdict if previous is not None else None
        chained = ChainedInputs(entries, unread, self._upload_fill, self.executor.block_size) if overlap else None
        self.trace.mark("forward.begin", batch=len(entries))
        hidden, logits = self.executor.forward([p.seq for p in entries], [p.chunk for p in entries],
                                               [p.num_drafts for p in entries],
                                               logits=[p.num_drafts + 1 if p.samples else 0 for p in entries],
                                               before=chained, checkpoints=[p.checkpoint for p in entries],
                                               replays_on_device=chained.max_shift if chained else 0)
        staging = None if overlap else self.drafting.layout_hidden(entries, hidden)
        cached_before, epochs = [p.seq.num_cached for p in entries], [p.seq.cache_epoch for p in sampled]
        read_early, read_start = None, time.perf_counter()
        if unread is not None and any(p.seq.grammar is not None for p in sampled):
            for p in entries:                 # (the launch's bookkeeping before the read, as on the other path)
                p.launched()
            read_early, unread = self._read(previous), None
        verdict = self.verifying.verdict(entries, sampled, logits, self.executor.last_batch.input_ids, forced, unread,
                                         overlap) if sampled else None
        if staging is not None:      # the drafter's hidden rows placed by the accepted counts, before the sync
            staging.gather(hidden, verdict.accepted if verdict is not None else None)
        self.trace.mark("forward.launched")
        in_flight = InFlightStep.launch(sampled, verdict, epochs)
        if overlap:
            in_flight.drafts_answer = self.drafting.ask_on_device(
                self.step_count, entries, self.executor.last_batch, hidden, in_flight.emitted,
                verdict.accepted if verdict is not None else None)
        launched = LaunchedStep(in_flight, entries, cached_before, None if overlap else hidden, read_early)
        if read_early is None:
            for p in entries:
                p.launched()
        else:
            launched.read_early_seconds = time.perf_counter() - read_start
        return launched

    def _settle(self, step: LaunchedStep) -> None:
        """Attach a launched step's drafts (waiting for a drafter service's answer) and count them per sequence."""
        verdict = step.verdict
        if verdict.drafts_answer is None:
            return
        verdict.attach_drafts(*verdict.drafts_answer.settle())
        for p, count in zip(verdict.sampled, verdict.draft_counts):
            p.seq.drafted_on_device(count)

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's verdict (its one sync) and commit it: the accepted drafts move the caches' counts
        (unless the caches were released since), the tokens go to the request. A sequence that ended while the
        step ran (aborted, or stopped by the step before) drops its tokens. A synchronous step then asks the
        drafter for the next drafts."""
        self._settle(step)
        results = step.verdict.read()
        self.trace.mark("verified")
        outputs = []
        for p, epoch, result in zip(step.verdict.sampled, step.verdict.epochs, results):
            p.seq.read(result.num_accepted, result.drafts, epoch)
            if p.seq.finish_reason is None:
                outputs.append(self.requests.commit(p, result.tokens, result.num_accepted, result.logprobs,
                                                    self.stats))
        self.trace.mark("committed")
        if step.hidden is not None:
            rebuild = self.drafting.ask_after_read(self.step_count, list(zip(step.entries, step.cached_before)),
                                                   step.hidden)   # (the step's number: the drafter's replay check)
            for seq in reversed(rebuild):   # they prefill again, and the drafter sees all their hidden states
                self.scheduler.preempt(seq, "the drafter lost its hidden states", reuse_prefix=False)
        return outputs

    # ---- convenience -------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (all added at once); returns each completion's token ids."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self.requests.ids)}" for _ in prompts]
        for rid, prompt, sp in zip(ids, prompts, params):
            self.add_request(rid, prompt, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work:
            for o in self.step():
                out[o.request_id] += o.new_token_ids
        return [out[rid] for rid in ids]
