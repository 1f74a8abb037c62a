"""The drafter's side of each engine step: what the drafter is told, when its answers are read, and what a failure
costs (nothing but speed: a step without drafts).

Two ways to ask, chosen per step by the engine:
  - after a step is read (`ask_after_read`): the drafter gets each sequence's newly committed tokens (a DraftBatch,
    with their hidden rows when it needs them, gathered on the device before the step's sync: HiddenStaging).
    An in-process drafter answers at once; one that answers later (a drafter service) is read at the start of the
    next step (`collect`), so the step's tokens go out to the clients while it drafts.
  - at launch, from the step's unread verdict (`ask_on_device`): a drafter that drafts on the device gets the
    step's rows there (DeviceDraftStep, draft_inputs.py) and leaves [S, K] drafts on the device; the answer is a
    `DeviceDraftsAnswer`, settled when the engine next needs the drafts.
A step given no drafts (the draft policy's k = 0) does not ask a drafter of host tokens at all (the engine overlaps
it instead); the drafter is sent every token it has not seen (`sent`) when it is asked again. A drafter that
takes hidden rows, or drafts on the device, is asked every step (an MTP head then only catches up).
Only the sequences in the drafter (`Sequence.in_drafter`: not opted out, not given up on by the draft policy) are
sent; a step with none of them leaves the drafter alone.
A drafter that lacks a sequence's earlier context (it reconnected, or is a new process after a swap) says so; the
sequence is re-sent whole to a token-only drafter, or recomputed (the sequences `ask_after_read` returns) for one
that needs hidden states, so that the drafter sees every hidden state again as the prefill runs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from specdec.drafting import (AnswersLater, DeviceDrafts, DeviceDraftStep, DraftBatch, DraftInput, DraftOutput, Drafter,
                              DraftsOnDevice, DraftsOnDeviceLater, OutputGrammar, device_drafts_problem,
                              proposal_problem)
from specdec.models.batch_staging import concat_ranges
from specdec.models.forward_batch import ForwardBatch
from specdec.models.pinned_upload import PinnedUpload
from specdec.step_trace import OFF, StepTrace

from .draft_inputs import chained_draft_step, prefix_blocks
from .hidden_staging import HiddenStaging
from .scheduler import ScheduledSeq
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class AwaitedDrafts:
    """Drafts asked for after a step was read, read at the start of the next."""
    answer: Callable[[], DraftOutput]   # the drafter interface's answer (AnswersLater), or its propose to call
    batch: DraftBatch
    seqs: list[Sequence]          # batch.seqs's sequences, in order


@dataclass
class DeviceDraftsAnswer:
    """A drafter's drafts for a launched step: `settle` waits for a drafter service's answer, checks it and returns
    the sampled rows' drafts ([S, K] on the device, or None) and their counts."""
    stage: "DraftingStage"
    answer: Callable[[], DeviceDrafts]  # DraftsOnDeviceLater's answer, or draft_on_device to call
    step: DeviceDraftStep
    rows: list[int]               # [S] each sampled entry's place in the drafter's step (-1: out of the drafter)
    sampled: torch.Tensor         # [S] the same on the device (0 for those out: their count is 0)

    def settle(self) -> tuple[torch.Tensor | None, list[int]]:
        return self.stage.checked_device_drafts(self)


@dataclass
class DraftingStage:
    drafter: Drafter | None
    num_drafts: int               # the engine's configured k
    vocab_size: int
    staging_rows: int             # the most rows of one step (for the hidden rows' staging buffer)
    upload_rows: PinnedUpload
    step_drafts: int = 0          # drafts asked per sequence this step (the draft policy's k; k when fixed)
    fallback_steps: int = 0       # steps decoded with k = 0 although a drafter is configured
    seconds: float = 0.0          # this step's host time asking and reading answers
    compute_seconds: float | None = None   # this step's drafting time as the drafter measured it (a remote one)
    awaited: AwaitedDrafts | None = None   # drafts asked for after a read, not read yet
    context_lost: set[int] = field(default_factory=set)   # seq ids whose context the drafter reported missing
    sent: dict[int, int] = field(default_factory=dict)    # seq id -> where its next DraftInput starts (the tokens
                                                          # before it were sent to the drafter)
    staging: HiddenStaging | None = None
    block_size: int = 16          # the target's KV block (what prefix caching's hashes cover)
    last_failure: str = ""
    trace: StepTrace = OFF

    @property
    def k(self) -> int:
        """k for this step: the configured k, capped by what the drafter can do (0 while it is away)."""
        return 0 if self.drafter is None else min(self.num_drafts, self.drafter.max_drafts)

    @property
    def drafts_on_device(self) -> bool:
        """The drafter drafts on the device from an unread verdict right now."""
        d = self.drafter
        return isinstance(d, DraftsOnDevice) and d.drafts_on_device and self.k > 0

    @property
    def skips_drafter(self) -> bool:
        """This step's drafter may be left out: it asks for no drafts (k = 0) and the drafter takes host tokens
        only (it is sent what it missed when it is next asked)."""
        d = self.drafter
        return (d is not None and self.k > 0 and self.step_drafts == 0 and not d.needs_hidden
                and not self.drafts_on_device)

    def forget(self, seqs: list[Sequence]) -> None:
        """These sequences' context is gone (preempted, finished, aborted), or they leave the drafter: it may free
        theirs (only the drafter's sequences are named: the others it never saw)."""
        for s in seqs:
            self.sent.pop(s.seq_id, None)
        known = [s.seq_id for s in seqs if s.in_drafter]
        if self.drafter is not None and known:
            self.drafter.release(known)

    # ---- after a step is read -------------------------------------------------------------------
    def layout_hidden(self, entries: list[ScheduledSeq], hidden: torch.Tensor) -> HiddenStaging | None:
        """Before the sync: lay out this step's hidden rows for a drafter that takes them, or None."""
        if self.staging is not None:
            self.staging.staged = False
        if self.drafter is None or self.k == 0 or not self.drafter.needs_hidden:
            return None
        if not all(p.seq.in_drafter for p in entries):   # (some rows stay out: gathered after the sync)
            return None
        rows = hidden.shape[0]
        if self.staging is None or self.staging.max_rows < rows or self.staging.buffer.dtype != hidden.dtype:
            self.staging = HiddenStaging(max(rows, self.staging_rows), hidden.shape[1], hidden.dtype, hidden.device)
        self.staging.layout([len(p.chunk) for p in entries], [p.num_drafts for p in entries],
                          [i for i, p in enumerate(entries) if p.samples])
        return self.staging

    def ask_after_read(self, step_number: int, committed: list[tuple[ScheduledSeq, int]], hidden: torch.Tensor
                       ) -> list[Sequence]:
        """Send the drafter what each live sequence committed this step (entry, num_cached before the step);
        its proposals are for the next step (read now from an in-process drafter, at the start of the next step
        from one that answers later). Returns the sequences to recompute for the drafter."""
        drafter, k = self.drafter, self.k
        if drafter is not None and k == 0 and self.num_drafts > 0:
            self.failed("the drafter is not connected")  # this step decodes without drafts
        inputs, live, row_starts, row_counts, first_row, rebuild, prefixes = [], [], [], [], 0, [], []
        for p, old in committed:
            seq = p.seq
            if seq.finish_reason is None:
                seq.proposed([], None)
                item = self._draft_input(seq, old, k)
                if item is None and k > 0 and seq.seq_id in self.context_lost:
                    rebuild.append(seq)
                elif item is not None:
                    inputs.append(item)
                    live.append(seq)
                    prefixes += prefix_blocks(p, self.block_size)
                    self.sent[seq.seq_id] = seq.num_cached
                    if item.start_pos == old:  # the committed tokens' hidden rows
                        row_starts.append(first_row)
                        row_counts.append(seq.num_cached - old)
            first_row += len(p.chunk)
        self.context_lost.difference_update(seq.seq_id for seq in rebuild)
        if drafter is None or k == 0 or not live:
            return rebuild
        rows = None
        if drafter.needs_hidden:  # every sequence's committed rows in batch order: staged before the sync
            staged = self.staging is not None and self.staging.staged and len(row_starts) == len(committed)
            rows = self.staging.rows(sum(row_counts)) if staged else \
                hidden[self.upload_rows(concat_ranges(row_starts, row_counts))]
        self.trace.mark("draft.inputs")
        start = time.perf_counter()
        batch = DraftBatch(step_number, inputs, rows, prefixes)
        later = isinstance(drafter, AnswersLater)
        self.awaited = AwaitedDrafts(self._send(drafter, batch) if later else partial(drafter.propose, batch),
                                     batch, live)
        self.seconds += time.perf_counter() - start
        if not later:  # an in-process drafter answers now
            self.collect()
        return rebuild

    def prune_lost(self, running: set[int]) -> None:
        """Forget lost contexts of sequences no longer running (finished or aborted meanwhile)."""
        self.context_lost &= running

    def collect(self) -> None:
        """Read the awaited answer (if any) into its sequences' drafts."""
        awaited, self.awaited = self.awaited, None
        if awaited is None:
            return
        start, asked = time.perf_counter(), awaited.batch.seqs
        try:
            out = awaited.answer()
        except Exception as e:  # a drafter's bug must not take the verifier down
            out = self._raised(e, len(asked))
        problem = out.failure or proposal_problem(out, asked, self.vocab_size)
        if problem:   # a failed, broken or malformed answer: no drafts for anyone this step (k = 0), logged
            self.failed(problem)
            out = DraftOutput.failed(len(asked), problem)
        self.seconds += time.perf_counter() - start
        self.compute_seconds = out.compute_seconds
        self.context_lost.update(out.missing)
        offset = 0
        for seq, drafts in zip(awaited.seqs, out.drafts):  # a sequence that ended meanwhile leaves them unused
            n = len(drafts)
            seq.proposed(list(drafts), out.probs[offset:offset + n] if out.probs is not None else None)
            offset += n

    # ---- at launch, on the device ---------------------------------------------------------------
    def ask_on_device(self, step_number: int, entries: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor,
                      emitted: torch.Tensor | None, accepted: torch.Tensor | None) -> DeviceDraftsAnswer | None:
        """Ask the drafter for the sampled entries' next drafts from the launched step's unread verdict (None:
        no drafter or k = 0). An in-process drafter has queued them when this returns; a drafter service
        answers later: its host work runs while the engine reads the last step and delivers its tokens."""
        if not self.drafts_on_device or not any(p.seq.in_drafter for p in entries):   # (skipped: skips_drafter)
            return None
        start = time.perf_counter()
        device_step, places, sampled = chained_draft_step(step_number, entries, batch, hidden, emitted, accepted,
                                                          min(self.k, self.step_drafts), self.upload_rows,
                                                          self.block_size)
        drafter = self.drafter
        try:
            if isinstance(drafter, DraftsOnDeviceLater):
                answer = drafter.draft_on_device_later(device_step)
            else:   # in process: queued now, read (no sync) when settled
                answer = _answered(drafter.draft_on_device(device_step))
        except Exception as e:  # a drafter's bug must not take the verifier down
            answer = _answered(self._device_raised(e, len(device_step.seq_ids)))
        self.seconds += time.perf_counter() - start
        return DeviceDraftsAnswer(self, answer, device_step, places, sampled)

    def checked_device_drafts(self, a: DeviceDraftsAnswer) -> tuple[torch.Tensor | None, list[int]]:
        """The drafter's answer checked, and its rows of the sampled entries."""
        start = time.perf_counter()
        try:
            out = a.answer()
        except Exception as e:  # a drafter's bug must not take the verifier down
            out = self._device_raised(e, len(a.step.seq_ids))
        self.seconds += time.perf_counter() - start
        problem = out.failure or device_drafts_problem(out, a.step, self.k)
        if problem:
            self.failed(problem)
            return None, [0] * len(a.rows)
        self.context_lost.update(out.missing)   # (pruned to the running ones; the next step recomputes them)
        # ids outside the vocabulary cannot be checked on the host without a sync: clamped on the device (the
        # target verifies every draft, so a wrong id costs acceptance, never correctness)
        return out.tokens[a.sampled].clamp_(0, self.vocab_size - 1), [out.counts[i] if i >= 0 else 0 for i in a.rows]

    # ---- failures -------------------------------------------------------------------------------
    def failed(self, reason: str) -> None:
        self.fallback_steps += 1
        if reason != self.last_failure or self.fallback_steps % 100 == 0:
            log.warning("drafter failure (%d steps so far without drafts): %s", self.fallback_steps, reason)
            self.last_failure = reason

    def _send(self, drafter: AnswersLater, batch: DraftBatch) -> Callable[[], DraftOutput]:
        """Ask a drafter that answers later; a send that raises is a failed answer."""
        try:
            return drafter.propose_later(batch)
        except Exception as e:  # a drafter's bug must not take the verifier down
            return _answered(self._raised(e, len(batch.seqs)))

    def _raised(self, error: Exception, num_seqs: int) -> DraftOutput:
        kind = getattr(self.drafter, "kind", "(detached)")  # an answer read after the drafter was detached
        log.exception("drafter %s raised; this step decodes without drafts", kind, exc_info=error)
        return DraftOutput.failed(num_seqs, f"{type(error).__name__}: {error}")

    def _device_raised(self, error: Exception, num_seqs: int) -> DeviceDrafts:
        kind = getattr(self.drafter, "kind", "(detached)")
        log.exception("drafter %s raised; the next step decodes without drafts", kind, exc_info=error)
        return DeviceDrafts(None, [0] * num_seqs, failure=f"{type(error).__name__}: {error}")

    def _draft_input(self, seq: Sequence, old: int, k: int) -> DraftInput | None:
        """What the drafter gets for `seq` this step: the tokens committed since `old` (since it was last sent
        some, for a drafter of host tokens; the whole context if the drafter lost it and can take tokens alone), or
        None (no drafter, the sequence is out of it, or a recompute is needed first)."""
        if self.drafter is None or k == 0:
            return None
        lost = seq.seq_id in self.context_lost and old > 0    # the drafter lost what it was sent of it
        if lost and seq.in_drafter and self.drafter.needs_hidden:
            return None                                       # (still lost: recomputed first)
        self.context_lost.discard(seq.seq_id)
        if not seq.in_drafter:
            return None
        start = 0 if lost else old if self.drafter.needs_hidden else min(old, self.sent.get(seq.seq_id, 0))
        first = start == 0 or seq.seq_id not in self.sent   # (a sequence resumed from a cached prefix starts later)
        want = max(0, min(k, self.step_drafts, seq.remaining - 1)) if seq.is_decoding else 0
        return DraftInput(seq.seq_id, start, seq.token_ids[start:seq.num_cached + 1], want,
                          _grammar_of(seq) if first else None)


def _grammar_of(seq: Sequence) -> OutputGrammar | None:
    """A constrained sequence's grammar, for the drafter (sent when it starts the sequence from position 0)."""
    grammar = seq.params.grammar
    return None if grammar is None else OutputGrammar(grammar, seq.num_prompt)


def _answered(out):
    """An answer that is in already, in the shape of the drafter interface's answers (a call)."""
    return lambda: out
