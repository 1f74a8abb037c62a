"""A request as the verifier runs it: its tokens, sampling parameters, cache placement and statistics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

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
    gdn_slot: int = -1
    gdn_read_offset: int = 0             # drafts of the last step accepted: GDN replays them, conv column
    pending: int = 0                     # launched steps that sampled and are not read yet (0 or 1 when scheduling)
    unread_accepts: int = 0              # drafts of the newest unread step: num_cached grows by up to this at its read
    device_drafts: int = 0               # drafts the newest unread step left on the device for the next one
    verify_launches: int = 0             # verify steps launched (forced acceptance's key)
    cache_epoch: int = 0                 # bumped when its caches are released (a late read must not move them)
    drafts: list[int] = field(default_factory=list)  # proposals to verify in the next step
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] the drafter's q, None: argmax (one-hot)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    penalty: PenaltyState | None = None  # built on first use by a penalised request
    arrived_at: float = field(default_factory=time.monotonic)  # when the engine took the request
    queue_seconds: float | None = None   # from arrival to its first admission into the running batch

    def penalty_state(self, vocab: int, device: torch.device) -> PenaltyState:
        if self.penalty is None:
            counts = torch.zeros(vocab, dtype=torch.int32)
            counts.index_add_(0, torch.tensor(self.output_ids, dtype=torch.long),
                              torch.ones(len(self.output_ids), dtype=torch.int32))
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[torch.tensor(self.token_ids[:self.num_prompt], dtype=torch.long)] = True
            self.penalty = PenaltyState(counts.to(device), mask.to(device))
        return self.penalty

    def append_output(self, tokens: list[int]) -> None:
        """Commit emitted tokens (and count them for penalties)."""
        self.token_ids += tokens
        if self.penalty is not None and tokens:
            ids = torch.tensor(tokens, dtype=torch.long).to(self.penalty.output_counts.device, non_blocking=True)
            self.penalty.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_decoding(self) -> bool:
        """Output has begun and all but the last token are cached: the next step verifies [last, drafts...].
        (A prompt's own last token is still prefill.) The last token may be pending: sampled by a step that
        is still running, then the next step takes it from the device. (num_cached and token_ids both leave
        out the unread step's accepted drafts, so the test holds while they are unknown.)"""
        length = len(self.token_ids) + self.pending
        return self.num_cached == length - 1 and length > self.num_prompt

    @property
    def remaining(self) -> int:
        """Tokens it may still emit, at least: the unread step's are counted as if all its drafts were accepted."""
        return self.params.max_tokens - len(self.output_ids) - self.pending - self.unread_accepts
