"""Overlapped steps, the engine's step while no request has penalties or logprobs and drafts (if any) come from
a drafter that drafts on the device: step n + 1 is launched before step n is read (docs/architecture.md,
"Overlapped steps").

    step():  settle step n's drafts (a drafter service's answer)  →  schedule  →  launch step n + 1: its inputs
             from step n's unread verdict (ChainedInputs), the forward, its verdict and the drafter's next drafts
             on the device  →  read step n (the one host wait) and commit it

SpecEngine takes these methods (this file is the engine's overlapped half; engine.py the synchronous one)."""
from __future__ import annotations

import logging
import time
from itertools import chain
from typing import TYPE_CHECKING, Callable

import torch

from specdec.drafting import DeviceDrafts, DraftsOnDevice, DraftsOnDeviceLater, device_drafts_problem

from .in_flight import ChainedInputs, InFlightStep
from .launch_verdict import chained_draft_step, launch_verdict
from .scheduler import ScheduledSeq

if TYPE_CHECKING:
    from .engine import RequestOutput

log = logging.getLogger(__name__)


class OverlappedSteps:
    def _overlaps(self) -> bool:
        """Can this step be launched before the last one's tokens are read? Only when no request has penalties
        or logprobs (they need the tokens on the host each step; greedy and sampled requests are decided on the
        device) and drafts, if any, come from a drafter that drafts on the device from the unread verdict (an
        in-process MTP head, or an MTP drafter service through device steps); a drafter that needs the tokens on
        the host (n-gram, a drafter service on another host or counting tokens) and a drafter that lost context
        run synchronous steps. The engine changes mode between two steps."""
        if not self.config.overlap or self._context_lost:
            return False
        drafter = self.drafter
        if self.config.num_drafts > 0 and drafter is not None and not (
                isinstance(drafter, DraftsOnDevice) and drafter.drafts_on_device and self.num_drafts > 0):
            return False
        sched = self.scheduler
        return all(s.params.decided_on_device for s in chain(sched.running, sched.waiting))

    def _overlapped_step(self) -> list[RequestOutput]:
        self._collect_drafts()             # an answer a synchronous step asked for: drafts on the host
        if self._in_flight is not None:
            self._settle(self._in_flight)  # its drafts, which this step's sequences verify
        plan = self.scheduler.schedule()   # a sequence whose last step is unread decodes from the device
        if self.drafter is not None and self.scheduler.preempted:
            self.drafter.release([s.seq_id for s in self.scheduler.preempted])
        previous, self._in_flight = self._in_flight, None
        launch_seconds, asked = 0.0, self._drafter_seconds   # (the drafter's time so far: its answers read)
        if plan:
            start = time.perf_counter()
            self._in_flight = self._launch(plan, previous)
            launch_seconds = time.perf_counter() - start
        asked = self._drafter_seconds - asked                # asking the drafter, inside the launch
        start = time.perf_counter()
        outputs = self._finish_in_flight(previous) if previous is not None else []
        # "target": queueing this step (less asking the drafter); "verify": reading the last one; "drafter":
        # asking the drafter and reading its answers
        self.last_step_seconds = {"target": launch_seconds - asked, "verify": time.perf_counter() - start,
                                  "drafter": self._drafter_seconds}
        self._drafter_seconds = 0.0
        self.trace.mark("step.end")
        return outputs

    def _launch(self, plan: list[ScheduledSeq], previous: InFlightStep | None) -> InFlightStep:
        """Queue the step's forward, its verdict and the drafter's next drafts; advance the caches' counts by
        what the host knows (the accepted drafts follow when the step is read) and mark the verdict pending."""
        self.step_count += 1
        self.overlapped_draft_steps += any(p.num_drafts for p in plan)
        sampled = [p for p in plan if p.samples]                 # before the counts below move
        inputs = ChainedInputs(plan, previous, self._upload_fill, self.runner.block_size)
        forced = self._forced_counts(sampled)
        self.trace.mark("forward.begin", batch=len(plan))
        hidden, logits = self.runner.forward([p.seq for p in plan], [p.chunk for p in plan],
                                             [p.num_drafts for p in plan],
                                             logits=[p.num_drafts + 1 if p.samples else 0 for p in plan],
                                             before=inputs)
        tokens, accepted = launch_verdict(plan, logits, self.runner.last_batch, forced, self._upload_drafts, previous,
                                          self._upload_sampling)
        self.trace.mark("forward.launched")
        launched = InFlightStep.launch(sampled, tokens, accepted)
        launched.settle = self._ask_drafts(plan, hidden, launched.emitted, accepted)
        for p in plan:
            p.seq.num_cached += len(p.chunk) - p.num_drafts
            p.seq.gdn_read_offset = 0
            p.seq.verify_launches += p.decoding
        for p in sampled:
            p.seq.pending += 1
            p.seq.unread_accepts, p.seq.device_drafts = p.num_drafts, 0   # the drafts' count when settled
        return launched

    def _ask_drafts(self, plan: list[ScheduledSeq], hidden: torch.Tensor, emitted: torch.Tensor | None,
                    accepted: torch.Tensor | None) -> Callable[[], tuple[torch.Tensor | None, list[int]]]:
        """Ask the drafter for the sampled entries' next drafts; returns what gives them ([S, K] on the device
        and their counts). An in-process drafter has queued them already; a drafter service answers later: its
        host work runs while this one reads the last step and delivers its tokens."""
        rows = [i for i, p in enumerate(plan) if p.samples]
        if self.drafter is None or self.num_drafts == 0:
            return lambda: (None, [0] * len(rows))
        start = time.perf_counter()
        step, sampled = chained_draft_step(self.step_count, plan, self.runner.last_batch, hidden, emitted,
                                           accepted, self.num_drafts, self._upload_rows)
        drafter = self.drafter
        try:
            answer = drafter.draft_on_device_later(step) if isinstance(drafter, DraftsOnDeviceLater) else \
                _at_once(drafter.draft_on_device(step))
        except Exception as e:  # a drafter's bug must not take the verifier down
            answer = self._device_raised(e, len(plan))
        self._drafter_seconds += time.perf_counter() - start
        return lambda: self._device_drafts(answer, step, rows, sampled)

    def _device_drafts(self, answer: Callable[[], DeviceDrafts], step, rows: list[int], sampled: torch.Tensor
                       ) -> tuple[torch.Tensor | None, list[int]]:
        """The drafter's answer checked, and its rows of the sampled entries (`sampled` [S]: their plan places)."""
        start = time.perf_counter()
        try:
            out = answer()
        except Exception as e:  # a drafter's bug must not take the verifier down
            out = self._device_raised(e, len(step.seq_ids))()
        self._drafter_seconds += time.perf_counter() - start
        problem = out.failure or device_drafts_problem(out, step, self.num_drafts)
        if problem:
            self._drafter_failed(problem)
            return None, [0] * len(rows)
        # the next step runs synchronously and recomputes them (those still running)
        self._context_lost.update(set(out.missing) & {s.seq_id for s in self.scheduler.running})
        # ids outside the vocabulary cannot be checked on the host without a sync: clamped on the device (the
        # target verifies every draft, so a wrong id costs acceptance, never correctness)
        return out.tokens[sampled].clamp_(0, self.runner.config.vocab_size - 1), [out.counts[i] for i in rows]

    def _device_raised(self, error: Exception, num_seqs: int) -> Callable[[], DeviceDrafts]:
        kind = getattr(self.drafter, "kind", "(detached)")
        log.exception("drafter %s raised; the next step decodes without drafts", kind, exc_info=error)
        out = DeviceDrafts(None, [0] * num_seqs, failure=f"{type(error).__name__}: {error}")
        return lambda: out

    def _settle(self, step: InFlightStep) -> None:
        """Attach a launched step's drafts (waiting for a drafter service's answer) and count them per sequence."""
        if step.settle is None:
            return
        drafts, counts = step.settle()
        step.attach_drafts(drafts, counts)
        for p, count in zip(step.sampled, counts):
            if p.seq.pending == 1:   # (its newest launch: no later one was made before this settles)
                p.seq.device_drafts = count

    def _finish_in_flight(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's verdict (its one sync) and commit it: the accepted drafts move the caches'
        counts (unless the caches were released since), the tokens go to the request, the drafts stay with a
        sequence not launched again. A sequence that ended while the step ran (aborted, or stopped by the step
        before) drops its tokens."""
        self._settle(step)
        results = step.read()
        self.trace.mark("verified")
        outputs = []
        for p, epoch, result in zip(step.sampled, step.epochs, results):
            seq = p.seq
            seq.pending -= 1
            last = seq.pending == 0                       # no later launch of it is unread
            if seq.cache_epoch == epoch:
                seq.num_cached += result.num_accepted
                if last:
                    seq.gdn_read_offset = result.num_accepted
            if last:   # (drafts of caches released since are stale: the sequence prefills again)
                seq.unread_accepts, seq.device_drafts = 0, 0
                seq.drafts, seq.draft_probs = result.drafts if seq.cache_epoch == epoch else [], None
            if seq.finish_reason is None:
                outputs.append(self._commit_tokens(p, result.tokens, result.num_accepted, None))
        self.trace.mark("committed")
        return outputs


def _at_once(out: DeviceDrafts) -> Callable[[], DeviceDrafts]:
    return lambda: out
