"""A request as the verifier runs it: its tokens, sampling parameters, cache placement and statistics.

Every change of a sequence's state is one of the methods below, called by the one component that owns that
moment: the block manager (`took_slot`, `took_blocks`, `caches_released`), the scheduler (`admitted`,
`preempted`), the engine (`launched`, `drafted_on_device`, `read`, `emitted`, `verified`, `left_drafter`,
`finished`) and the drafting stage (`proposed`). A step's life for one sequence:

    launched(chunk)   the forward of [cached tokens..., chunk] is queued: the committed part of the chunk is
                      cached; when the chunk samples, a verdict is unread (unread_steps += 1) whose accepted drafts
                      (up to unread_accepts) only the device knows
    read(result)      the verdict is on the host: its accepted drafts are cached too (unless the caches were
                      released since: cache_epoch), and the GDN state is read past them next step
    emitted(tokens)   the accepted drafts and the recovered / bonus token join the output
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.grammar import TokenMatcher
from specdec.sampling_params import SamplingParams

from .acceptance_stats import AcceptanceStats


@dataclass
class PenaltyState:
    """What penalties count, kept on the device and updated as tokens are committed."""
    output_counts: torch.Tensor          # [V] int32 occurrences of each token in the output
    prompt_mask: torch.Tensor            # [V] bool tokens of the prompt (repetition penalty)


@dataclass(eq=False)   # one request's state: equal only to itself (the scheduler's list lookups compare identity)
class Sequence:
    seq_id: int
    token_ids: list[int]                 # prompt + committed output
    num_prompt: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0                        # the request's seed, or one drawn for it
    request_id: str = ""
    num_cached: int = 0                  # tokens whose KV / GDN state is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chain hashes of its first whole blocks of tokens
    cached_tokens: int = 0               # prompt tokens its first admission took from the prefix cache
    reuse_prefix: bool = True            # may resume from the prefix cache (not after its drafter lacked one)
    resumed_from: int | None = None      # the hash of the prefix checkpoint its caches were restored from
    gdn_slot: int = -1
    gdn_read_offset: int = 0             # drafts of the last step accepted: GDN replays them, conv column
    unread_steps: int = 0                # launched steps that sampled and are not read yet (0 or 1 when scheduling)
    unread_accepts: int = 0              # drafts of the newest unread step: num_cached grows by up to this at its read
    device_drafts: int = 0               # drafts the newest unread step left on the device for the next one
    verify_launches: int = 0             # verify steps launched (forced acceptance's key)
    cache_epoch: int = 0                 # bumped when its caches are released (a late read must not move them)
    in_drafter: bool = True              # the drafter sees its tokens (and hidden rows) and drafts for it; False
                                         # when it opted out (speculation: false) or the draft policy gave up on it
    drafts: list[int] = field(default_factory=list)  # proposals to verify in the next step
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] the drafter's q, None: argmax (one-hot)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    penalty: PenaltyState | None = None  # built on first use by a penalised request
    grammar: TokenMatcher | None = None  # its grammar's state after the committed output (None: unconstrained)
    arrived_at: float = field(default_factory=time.monotonic)  # when the engine took the request
    queue_seconds: float | None = None   # from arrival to its first admission into the running batch

    def __post_init__(self):
        self.in_drafter = self.in_drafter and self.params.speculation

    # ---- cache placement (the block manager) -------------------------------------------------
    def took_slot(self, slot: int) -> None:
        self.gdn_slot, self.gdn_read_offset = slot, 0

    def took_blocks(self, blocks: list[int]) -> None:
        self.block_table += blocks

    def hashed(self, hashes: list[int]) -> None:
        """Its block hashes, as far as the prefix cache needed them (tokens only grow: they stay true)."""
        self.block_hashes = hashes

    def resumed(self, num_cached: int, checkpoint_hash: int) -> None:
        """Its caches were restored from the prefix cache up to `num_cached` (a checkpoint of committed tokens)."""
        self.num_cached, self.gdn_read_offset, self.resumed_from = num_cached, 0, checkpoint_hash
        if self.queue_seconds is None:   # (before its first admission: what usage reports)
            self.cached_tokens = min(num_cached, self.num_prompt)

    def caches_released(self) -> None:
        """Its blocks and slot went back: it prefills again from the start (a late read must not move it)."""
        self.block_table, self.gdn_slot, self.num_cached, self.gdn_read_offset = [], -1, 0, 0
        self.cache_epoch += 1

    # ---- scheduling (the scheduler) ------------------------------------------------------------
    def admitted(self) -> None:
        """Taken into the running batch; the first admission ends its queue time (a preempted one re-queues)."""
        if self.queue_seconds is None:
            self.queue_seconds = time.monotonic() - self.arrived_at

    def preempted(self, reuse_prefix: bool = True) -> None:
        """Back to the queue by recompute (the block manager released its caches): its drafts are stale. Without
        `reuse_prefix` it prefills from its first token (its drafter could not resume it from a cached prefix)."""
        self.drafts, self.draft_probs = [], None
        self.reuse_prefix = self.reuse_prefix and reuse_prefix
        if not reuse_prefix:   # (usage counts what was not computed: it will be)
            self.cached_tokens = 0

    # ---- one step (the engine) --------------------------------------------------------------------
    def launched(self, chunk_len: int, num_drafts: int, samples: bool, decoding: bool) -> None:
        """A forward over `chunk_len` tokens (its last `num_drafts` drafts) is queued."""
        self.num_cached += chunk_len - num_drafts
        self.gdn_read_offset = 0
        self.verify_launches += decoding
        if samples:
            self.unread_steps += 1
            self.unread_accepts, self.device_drafts = num_drafts, 0   # the drafts' count when they are settled

    def drafted_on_device(self, count: int) -> None:
        """The drafter left `count` drafts on the device for its newest launch (read with it)."""
        if self.unread_steps == 1:
            self.device_drafts = count

    def read(self, num_accepted: int, drafts: list[int], epoch: int) -> None:
        """A launched verdict is read: `num_accepted` of its drafts were accepted; `drafts` are the drafter's for
        the next step (on the device with it). `epoch`: the cache epoch at launch."""
        self.unread_steps -= 1
        last = self.unread_steps == 0                         # no later launch of it is unread
        current = self.cache_epoch == epoch
        if current:
            self.num_cached += num_accepted
            if last:
                self.gdn_read_offset = num_accepted
        if last:   # (drafts of caches released since are stale: the sequence prefills again)
            self.unread_accepts, self.device_drafts = 0, 0
            self.drafts, self.draft_probs = (drafts if current else []), None

    def emitted(self, tokens: list[int]) -> None:
        """Commit emitted tokens (count them for penalties, walk the grammar through them)."""
        self.token_ids += tokens
        if self.grammar is not None:
            self.grammar.accept(tokens)
        if self.penalty is not None and tokens:
            ids = torch.tensor(tokens, dtype=torch.long).to(self.penalty.output_counts.device, non_blocking=True)
            self.penalty.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def verified(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """A verify step of it was committed: its acceptance statistics count it."""
        self.stats.record(num_drafts, num_accepted, num_emitted)

    def proposed(self, drafts: list[int], probs: torch.Tensor | None) -> None:
        """A drafter's proposals for the next step (q: [len(drafts), V], or None for argmax drafters)."""
        self.drafts, self.draft_probs = drafts, probs

    def left_drafter(self) -> None:
        """The draft policy gave up on it: it decodes without drafts from now on (its pending ones are dropped)."""
        self.in_drafter, self.drafts, self.draft_probs = False, [], None

    def finished(self, reason: str) -> None:
        self.finish_reason = reason

    # ---- derived -------------------------------------------------------------------------------
    def penalty_state(self, vocab: int, device: torch.device) -> PenaltyState:
        if self.penalty is None:
            counts = torch.zeros(vocab, dtype=torch.int32)
            counts.index_add_(0, torch.tensor(self.output_ids, dtype=torch.long),
                              torch.ones(len(self.output_ids), dtype=torch.int32))
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[torch.tensor(self.token_ids[:self.num_prompt], dtype=torch.long)] = True
            self.penalty = PenaltyState(counts.to(device), mask.to(device))
        return self.penalty

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_decoding(self) -> bool:
        """Output has begun and all but the last token are cached: the next step verifies [last, drafts...].
        (A prompt's own last token is still prefill.) The last token may be unread: sampled by a step that
        is still running, then the next step takes it from the device. (num_cached and token_ids both leave
        out the unread step's accepted drafts, so the test holds while they are unknown.)"""
        length = len(self.token_ids) + self.unread_steps
        return self.num_cached == length - 1 and length > self.num_prompt

    @property
    def remaining(self) -> int:
        """Tokens it may still emit, at least: the unread step's are counted as if all its drafts were accepted."""
        return self.params.max_tokens - len(self.output_ids) - self.unread_steps - self.unread_accepts
