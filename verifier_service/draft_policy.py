"""How many drafts each step verifies: a fixed k, or the k that maximises expected tokens per second.

Adaptive rule, per step, for the B sequences that decode (those that opted out with `speculation: false` verify
none and count as one token):

    k* = argmax over k in 0..K of   sum_i E(a_i, k) / T(B, k),    E(a, k) = 1 + a + ... + a^k

unless it beats k = K by less than MARGIN (the measured costs of neighbouring k differ by about their noise:
a near tie keeps K, the fixed policy's choice). T(B, k) is the measured wall time of a step of B decoding
sequences verifying k drafts each, the drafter's work included (`measure_step_costs`, run at start-up through the
real engine and drafter), and a_i is sequence i's per-token acceptance estimate: a draft is accepted with
probability a while the ones before it were, so a verify step of k drafts that accepted j < k of them saw j
successes and one failure, and one that accepted all k saw k successes. Estimates are shrunk twice, so that one
early rejection does not read as a = 0:

    p   = (recent engine successes + M p0) / (recent engine observations + M)      p0 = PRIOR_RATE
    a_i = (successes_i + M p) / (observations_i + M)                              M = PRIOR_WEIGHT

"recent": each step weighs the engine's counts RECENT_DECAY times the step before. A run of EXPLORE_EVERY steps
chosen k = 0 is followed by EXPLORE_STEPS steps of one draft (a drafter drafts for the step after the one that
asks, and a drafter of host tokens skipped at k = 0 is asked again only after a synchronous step: one step would
verify nothing), so that estimates that fell too low can recover. The choice changes only how many drafts are
verified, never which tokens are emitted: speculation stays lossless.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np

from .acceptance_stats import AcceptanceStats

log = logging.getLogger(__name__)
POLICIES = ("auto", "fixed", "adaptive")
PRIOR_WEIGHT = 4.0          # observations a prior counts for (M above)
PRIOR_RATE = 0.5            # the rate before any draft was verified (p0)
EXPLORE_EVERY = 128         # steps chosen k = 0 in a row before drafts are tried again
EXPLORE_STEPS = 3           # steps of one draft each then
MARGIN = 0.03               # k* replaces K only when its expected tokens per second are this much higher
RECENT_DECAY = 0.95         # the engine-wide rate forgets old steps (about the last 20 count)


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step: seconds[i, k] for batch_sizes[i] decoding sequences verifying k drafts each."""
    batch_sizes: tuple[int, ...]          # increasing
    seconds: np.ndarray                   # [len(batch_sizes), K + 1]
    drafts: np.ndarray | None = None      # [len(batch_sizes), K + 1] drafts a verify step really had while timed

    def at(self, batch: int) -> np.ndarray:
        """[K + 1] seconds per step for `batch` sequences: linear between measured sizes, beyond the largest
        scaled with the batch (a step that large is throughput-bound)."""
        sizes = self.batch_sizes
        if batch <= sizes[0]:
            return self.seconds[0]
        if batch >= sizes[-1]:
            return self.seconds[-1] * (batch / sizes[-1])
        hi = bisect.bisect_left(sizes, batch)
        lo = hi - 1
        w = (batch - sizes[lo]) / (sizes[hi] - sizes[lo])
        return self.seconds[lo] * (1 - w) + self.seconds[hi] * w

    def table(self) -> str:
        """The table as the start-up log prints it: ms per step (and the drafts a verify step had, when known)."""
        head = "batch " + " ".join(f"k={k:<5d}" for k in range(self.seconds.shape[1]))
        drafts = self.drafts if self.drafts is not None else np.full_like(self.seconds, np.nan)
        rows = [f"{b:5d} " + " ".join(f"{t * 1e3:7.2f}" for t in row) + "   drafts " + " ".join(f"{d:.2f}" for d in dr)
                for b, row, dr in zip(self.batch_sizes, self.seconds, drafts)]
        return "\n".join([head] + rows)


def acceptance_rate(stats: AcceptanceStats) -> tuple[float, float]:
    """(successes, observations) of the per-token acceptance in `stats` (see the module docstring)."""
    return float(stats.accepted), float(stats.accepted + stats.rejected_steps)


def expected_tokens(rates: np.ndarray, max_drafts: int) -> np.ndarray:
    """[B, K + 1] E(a_i, k) = sum_{j <= k} a_i^j."""
    powers = rates[:, None] ** np.arange(max_drafts + 1)[None, :]
    return np.cumsum(powers, axis=1)


class DraftPolicy:
    """`choose` gives the k of a step: `max_drafts` when fixed (or before costs are measured), else the adaptive
    rule. `chosen` counts steps by the k they were given (the metrics' and the bench's view)."""

    def __init__(self, max_drafts: int, adaptive: bool, costs: StepCosts | None = None):
        self.max_drafts, self.adaptive, self.costs = max_drafts, adaptive, costs
        self.chosen = [0] * (max_drafts + 1)
        self._zeros = 0                   # steps chosen k = 0 in a row
        self._exploring = 0               # exploring steps left
        self._recent = np.zeros(2)        # the engine's decayed (successes, observations)
        self._counted = np.zeros(2)       # the engine's totals at the last step

    def choose(self, seq_stats: list[AcceptanceStats], engine_stats: AcceptanceStats, opted_out: int = 0) -> int:
        """k for a step of len(seq_stats) sequences that speculate and `opted_out` that do not."""
        k = self._choose(seq_stats, engine_stats, opted_out)
        self.chosen[k] += 1
        return k

    def _choose(self, seq_stats: list[AcceptanceStats], engine_stats: AcceptanceStats, opted_out: int) -> int:
        if not self.adaptive or self.costs is None or self.max_drafts == 0:
            return self.max_drafts
        if not seq_stats:
            return 0
        total = np.array(acceptance_rate(engine_stats))
        if (total < self._counted).any():   # the engine's counters started afresh (after the warm-up)
            self._counted = np.zeros(2)
        self._recent = self._recent * RECENT_DECAY + (total - self._counted)
        self._counted = total
        hits, seen = self._recent
        prior = (hits + PRIOR_WEIGHT * PRIOR_RATE) / (seen + PRIOR_WEIGHT)
        own = np.array([acceptance_rate(s) for s in seq_stats])                          # [B, 2]
        rates = np.clip((own[:, 0] + PRIOR_WEIGHT * prior) / (own[:, 1] + PRIOR_WEIGHT), 0.0, 0.999)
        top = min(self.max_drafts, self.costs.seconds.shape[1] - 1)   # the table's K (a drafter's k may be lower)
        tokens = expected_tokens(rates, top).sum(axis=0) + opted_out                     # [K + 1]
        rate = tokens / self.costs.at(len(seq_stats) + opted_out)                      # [K + 1] tokens per second
        k = int(np.argmax(rate))
        if rate[k] < rate[-1] * (1 + MARGIN):
            k = top
        if self._exploring:
            self._exploring -= 1
            return max(k, 1)
        self._zeros = self._zeros + 1 if k == 0 else 0
        if self._zeros >= EXPLORE_EVERY:
            self._zeros, self._exploring = 0, EXPLORE_STEPS - 1
            return 1
        return k

    def forget(self) -> None:
        """Start afresh (after the warm-up): no steps counted, no engine-wide rate."""
        self.chosen = [0] * (self.max_drafts + 1)
        self._zeros, self._exploring, self._recent, self._counted = 0, 0, np.zeros(2), np.zeros(2)
