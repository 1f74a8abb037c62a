"""Continuous batching: which sequences run this step, with which tokens.

Each step every running sequence gets a chunk: decoding ones verify [last committed, drafts...]; prefilling
ones take the next piece of their prompt (chunked prefill, mixed with decoding) within a token budget: at most
`prefill_chunk` tokens each, or `mixed_prefill_chunk` for all prompts together in a step that decoding sequences
share (a decoder waits for the whole step, so its gap grows with the prompt tokens), in equal pieces up to the next
checkpoint or the prompt's end.
Admission needs a free GDN slot and KV blocks for the first chunk (the block manager's). With prefix caching a
sequence is admitted at the longest cached checkpoint of its tokens (block_manager.py), and a prompt chunk ends
where the next checkpoint falls, so that the state there is kept. When blocks run out, kept checkpoints are dropped
first, then the most recently admitted sequence is preempted by recompute: its caches are freed and it re-prefills
prompt + output later. `schedule` returns the step's entries and the sequences it preempted (the drafter forgets them).

With `lone_prefill_chunk` (`--lone-prefill-chunk`), a running prompt whose next chunk is that long runs alone, in
steps that alternate with steps of everything else: on a GPU with fla-core a chunk alone replays its prefill graph,
where the chunked GDN kernel runs (a step that mixes it with decoders takes the token-serial one), and the decoders
still get a step between any two of its chunks.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from itertools import islice

from .block_manager import BlockManager
from .sequence import Sequence

log = logging.getLogger(__name__)
UNREAD_TOKEN = 0    # stands for an unread token in a chunk; the device copy is put in its place before the step


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 16           # sequences in the running batch (GDN slot groups)
    max_batched_tokens: int = 512   # tokens per target forward
    prefill_chunk: int = 256        # prompt tokens per sequence per step
    mixed_prefill_chunk: int = 0    # prompt tokens in all in a step that decoding sequences share (0: no cap)
    lone_prefill_chunk: int = 0     # a prompt chunk this long runs alone, every other step (0: always mixed)


@dataclass
class ScheduledSeq:
    seq: Sequence
    chunk: list[int]                # tokens to run, drafts included at the end
    num_drafts: int
    decoding: bool                  # a verify step of [last committed, drafts...] (else a prefill chunk)
    resumed: int = 0                # admitted at a cached prefix: the checkpoint's blocks (0: not)
    checkpoint: int = 0             # the chunk ends at the checkpoint of this many blocks (0: not at one)

    @property
    def samples(self) -> bool:      # does this chunk reach the end of the committed (and unread) tokens?
        seq = self.seq
        return seq.num_cached + len(self.chunk) - self.num_drafts == len(seq.token_ids) + seq.unread_steps

    def launched(self) -> None:
        """Its forward is queued: the sequence's counts move by what the host knows (Sequence.launched)."""
        self.seq.launched(len(self.chunk), self.num_drafts, self.samples, self.decoding)


@dataclass
class Schedule:
    """One step's work: an entry per sequence that runs, and the sequences preempted to make room."""
    entries: list[ScheduledSeq]
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig):
        self.blocks, self.config = blocks, config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_stats = blocks.stats   # prompt tokens looked up in the prefix cache at admissions, and hit
        self.last_lone = False          # did the last step run a prompt chunk alone?

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prompt_tokens_left(self) -> int:
        """Tokens still to be prefilled before every sequence decodes: the rest of the running ones that prefill and
        the whole of the waiting ones that could be admitted now (as many as there are free places in the batch),
        a preempted sequence's output included (it is recomputed). An upper bound: a waiting prompt's cached prefix
        is found only when it is admitted."""
        room = max(0, self.config.max_running - len(self.running))
        return (sum(len(s.token_ids) - s.num_cached for s in self.running if not s.is_decoding)
                + sum(len(s.token_ids) - s.num_cached for s in islice(self.waiting, room)))

    def _chunk(self, seq: Sequence, budget: int, max_drafts: int, prompt_limit: int, start: int | None = None
               ) -> tuple[list[int], int]:
        """The tokens `seq` runs this step and how many of them are drafts (a prompt chunk of at most `prompt_limit`
        tokens from `start`, default num_cached, ends at the next checkpoint if it reaches one)."""
        limit = min(max_drafts if seq.in_drafter else 0, budget - 1, seq.remaining - 1)
        if seq.is_decoding and seq.unread_steps:  # its token and drafts are on the device: the engine fills them in
            drafts = max(0, min(seq.device_drafts, limit))
            return [UNREAD_TOKEN] * (1 + drafts), drafts
        if seq.is_decoding:   # never more drafts than tokens it may still emit after the first
            drafts = seq.drafts[:max(0, limit)]
            return [seq.token_ids[-1]] + drafts, len(drafts)
        start = seq.num_cached if start is None else start
        return seq.token_ids[start:self._chunk_end(seq, start, min(prompt_limit, budget))], 0

    def _chunk_end(self, seq: Sequence, start: int, max_tokens: int) -> int:
        """Where a prompt chunk of at most `max_tokens` tokens from `start` ends. A checkpoint (or the prompt's end)
        further away is reached in equal pieces, so that no piece is a sliver: 1024 tokens to a checkpoint with
        at most 1009 a step run as 512 + 512, not 1009 + 15 (a step of its own for 15 tokens, that still reads
        every weight). The pieces ignore the graph buckets: with prefix caching off, 1100 tokens in chunks of at
        most 1024 run as 550 + 550, both in the 1024-token graph."""
        checkpoint = self.blocks.next_checkpoint(seq, start)
        goal = len(seq.token_ids) if checkpoint is None else checkpoint
        pieces = -(-(goal - start) // max_tokens)           # ceil: the steps it takes to reach goal
        return start + -(-(goal - start) // pieces)

    def _entry(self, seq: Sequence, chunk: list[int], num_drafts: int, resumed: int = 0) -> ScheduledSeq:
        """The step's entry of `seq` (its caches reserved): a prompt chunk that ends at a checkpoint says so."""
        decoding, end = seq.is_decoding, seq.num_cached + len(chunk)
        at_checkpoint = not decoding and self.blocks.next_checkpoint(seq, seq.num_cached) == end
        return ScheduledSeq(seq, chunk, num_drafts, decoding, resumed,
                            (end + 1) // self.blocks.block_size if at_checkpoint else 0)

    @staticmethod
    def _reach(seq: Sequence, chunk: list[int]) -> int:
        """Cache positions the chunk may reach: the unread step may still move it by its accepted drafts."""
        return seq.num_cached + seq.unread_accepts + len(chunk)

    def preempt(self, victim: Sequence, reason: str, reuse_prefix: bool = True) -> None:
        """Preempt by recompute: free the caches; the sequence prefills prompt + output again, first in line
        (from a cached prefix, unless not `reuse_prefix`)."""
        log.info("preempting sequence %s (%d tokens) by recompute: %s", victim.request_id or victim.seq_id,
                 len(victim.token_ids), reason)
        self.running.remove(victim)
        self.blocks.release(victim)
        if not reuse_prefix and victim.resumed_from is not None:
            self.blocks.forget(victim.resumed_from)
        victim.preempted(reuse_prefix)
        self.waiting.appendleft(victim)

    def _preempt_for_blocks(self, victim: Sequence, preempted: list[Sequence]) -> None:
        self.preempt(victim, "KV blocks ran out")
        preempted.append(victim)
        self.num_preemptions += 1

    def _long_prompts(self, max_drafts: int) -> list[Sequence]:
        """The running prompts whose next chunk (with the whole budget) is lone_prefill_chunk or longer, when some
        other runnable sequence would share their steps (none otherwise: long prompts only run together)."""
        if not self.config.lone_prefill_chunk:
            return []
        runnable = [seq for seq in self.running if self._can_run(seq)]
        long = [seq for seq in runnable if not seq.is_decoding and len(
            self._chunk(seq, self.config.max_batched_tokens, max_drafts, self.config.prefill_chunk)[0])
            >= self.config.lone_prefill_chunk]
        return long if len(long) < len(runnable) else []

    @staticmethod
    def _can_run(seq: Sequence) -> bool:
        """A sequence with an unread token runs only as a decode of it, and only if it may emit more: a
        preempted one waits for the token before it prefills again; one whose last token is unread has
        finished by length when that token is read."""
        return seq.remaining > 0 and (not seq.unread_steps or seq.is_decoding)

    def schedule(self, max_drafts: int) -> Schedule:
        """This step's entries; a decoding sequence verifies at most `max_drafts` of its drafts (none if it is out
        of the drafter)."""
        plan: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        budget = self.config.max_batched_tokens
        long = self._long_prompts(max_drafts)
        alone = self.last_lone = bool(long) and not self.last_lone      # the first one's turn, or everyone else's
        waiting_turn = set() if alone else {seq.seq_id for seq in long}
        # prompt tokens one prompt may take, and all prompts together: beside decoders, the mixed chunk (checked
        # before any preemption below: a decoder preempted for blocks leaves the cap as it was)
        prompt_limit, prompt_room = self.config.prefill_chunk, budget
        if self.config.mixed_prefill_chunk and not alone and any(
                seq.is_decoding and self._can_run(seq) for seq in self.running):
            prompt_limit = prompt_room = min(prompt_limit, self.config.mixed_prefill_chunk)
        for seq in long[:1] if alone else list(self.running):
            if seq not in self.running or budget <= 0 or not self._can_run(seq) or seq.seq_id in waiting_turn:
                continue
            if not seq.is_decoding and prompt_room <= 0:
                continue
            chunk, d = self._chunk(seq, budget, max_drafts, min(prompt_limit, prompt_room))
            while not self.blocks.fits(seq, self._reach(seq, chunk)) and seq in self.running:
                self._preempt_for_blocks(self.running[-1], preempted)
            if seq not in self.running:
                continue
            self.blocks.reserve(seq, self._reach(seq, chunk))
            plan.append(self._entry(seq, chunk, d))
            budget -= len(chunk)
            prompt_room -= 0 if seq.is_decoding else len(chunk)
        while (self.waiting and budget > 0 and prompt_room > 0 and len(self.running) < self.config.max_running
               and not alone):
            seq = self.waiting[0]
            if not self._can_run(seq):
                break
            hit = self.blocks.match(seq) if seq.reuse_prefix and seq.num_cached == 0 else None
            start = hit.num_cached(self.blocks.block_size) if hit is not None else seq.num_cached
            chunk, d = self._chunk(seq, budget, max_drafts, min(prompt_limit, prompt_room), start)
            if not self.blocks.can_admit(seq, start + len(chunk), hit):
                break
            self.waiting.popleft()
            self.running.append(seq)
            self.blocks.queried(seq, hit)
            if hit is not None:
                self.blocks.resume(seq, hit)
            seq.admitted()
            self.blocks.reserve(seq, seq.num_cached + len(chunk))
            plan.append(self._entry(seq, chunk, d, hit.num_blocks if hit is not None else 0))
            budget -= len(chunk)
            prompt_room -= len(chunk)
        return Schedule(plan, preempted)
