"""Drafted / accepted counts, per request and for the whole engine.

mean acceptance length = tokens emitted per verify step, the recovered or bonus token included.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    rejected_steps: int = 0     # verify steps that rejected one of their drafts (an acceptance run's end)
    drafted_at: list[int] = field(default_factory=list)   # [position] drafts proposed at draft position i
    accepted_at: list[int] = field(default_factory=list)  # [position] of which accepted

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        self.verify_steps += 1
        self.drafted += num_drafts
        self.accepted += num_accepted
        self.emitted += num_emitted
        self.rejected_steps += num_accepted < num_drafts
        grow = num_drafts - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_drafts):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < num_accepted)

    @property
    def mean_acceptance_length(self) -> float:
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def summary(self) -> str:
        per_pos = " ".join(f"{r:.2f}" for r in self.per_position_acceptance)
        return (f"verify steps {self.verify_steps}, drafted {self.drafted}, accepted {self.accepted}, "
                f"mean acceptance length {self.mean_acceptance_length:.2f}, per-position acceptance [{per_pos}]")
