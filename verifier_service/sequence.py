"""A request as the verifier runs it: its tokens, sampling parameters, cache placement and statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sampling_params import SamplingParams

from .acceptance_stats import AcceptanceStats


@dataclass
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
    gdn_read_offset: int = 0             # state slot / conv column holding the state after num_cached tokens
    drafts: list[int] = field(default_factory=list)  # proposals to verify in the next step
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] the drafter's q, None: argmax (one-hot)
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    drafter_generation: int = -1         # which drafter connection holds this sequence's context

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def is_decoding(self) -> bool:
        """Output has begun and all but the last committed token are cached: the next step verifies
        [last, drafts...]. (A prompt's own last token is still prefill.)"""
        return self.num_cached == len(self.token_ids) - 1 and len(self.token_ids) > self.num_prompt

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
