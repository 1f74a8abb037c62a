"""Benchmark-only: force an acceptance schedule while a real drafter runs at its true cost (the idea of
vLLM's synthetic rejection mode). Each draft position is accepted with probability a, independently, with a
chosen so the mean acceptance length is the requested one. The output is NOT the target's: refused unless
explicitly enabled, and every response produced with it is marked."""
from __future__ import annotations

import random

from specdec.drafting.acceptance_rate import acceptance_rate_for


class ForcedAcceptance:
    def __init__(self, mean_length: float, num_drafts: int, seed: int = 0, enabled: bool = False):
        if not enabled:
            raise PermissionError("forced acceptance changes the output and is for benchmarks only: "
                                  "enable it explicitly (--unsafe-forced-acceptance)")
        self.mean_length, self.num_drafts = mean_length, num_drafts
        self.rate = acceptance_rate_for(mean_length, num_drafts)
        self.seed = seed
        self.rng = random.Random(seed)

    def restart(self) -> None:
        """Draw the same schedule again from its start (a benchmark's timed run after an untimed warm-up)."""
        self.rng = random.Random(self.seed)

    def draw(self, seq_ids: list[int]) -> list[int]:
        """Accepted count per sequence: leading positions accepted while a coin with P(heads) = a says so."""
        out = []
        for _ in seq_ids:
            j = 0
            while j < self.num_drafts and self.rng.random() < self.rate:
                j += 1
            out.append(j)
        return out
