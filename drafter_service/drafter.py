"""What the verifier tells a drafter each step, and what a drafter answers (in-process form of drafter.proto).

Each engine step the verifier sends, per running sequence, the tokens committed since the last step with the
target's hidden states for them, and asks for `num_drafts` proposals:
    token_ids  = tokens at positions start_pos .. start_pos + n      (n + 1 tokens, all committed)
    hidden     = target hidden after the final norm at positions start_pos .. start_pos + n - 1  (n rows)
so pair i is (token at start_pos + i + 1, hidden at start_pos + i): the MTP input convention (DESIGN §2).
Consecutive calls overlap by one token. A new sequence starts with start_pos = 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class DraftInput:
    seq_id: int
    start_pos: int
    token_ids: list[int]
    num_drafts: int


@dataclass
class DraftBatch:
    step: int
    seqs: list[DraftInput]
    hidden: torch.Tensor | None = None  # [Σ n_i, H] rows in seqs order; None when the drafter needs none


@dataclass
class DraftOutput:
    drafts: list[list[int]]                               # per sequence, at most num_drafts tokens
    probs: torch.Tensor | None = field(default=None)      # [Σ len(drafts_i), V] or None: argmax (one-hot q)


class Drafter(Protocol):
    kind: str
    needs_hidden: bool
    max_drafts: int

    def propose(self, batch: DraftBatch) -> DraftOutput: ...

    def release(self, seq_ids: list[int]) -> None: ...

    def clear(self) -> None: ...
