"""Benchmark-only: force an acceptance schedule while a real drafter runs at its true cost (the idea of
vLLM's synthetic rejection mode). The output is NOT the target's: refused unless explicitly enabled, and every
response produced with it is marked.

The accepted count J of a verify step with k drafts has the law of k independent coins with P(heads) = a,
accepted while they come up heads (a chosen so that E[1 + J] is the requested mean length):

    P(J >= j) = a^j  (j <= k),  i.e. J = #{j < k : u >= 1 - a^(j+1)} for u uniform on [0, 1)

The quantile u of a sequence's n-th verify step is u = frac(offset(key) + n · φ), φ = (√5 − 1)/2, not a random
draw: the golden-ratio sequence covers [0, 1) evenly, so every sequence realises the requested mean within a
few steps (independent draws over the ~20 steps of a 64-token request miss it by ±0.3). Each step's count has
the law above; consecutive steps of one sequence are not independent. The key is the request's sampling seed,
so the schedule depends only on (seed, n): requests that carry seeds (the bench's do) get the same counts
in-process and through the gateway, in a warm-up and in the timed run, whatever batches they share; a request
without one gets a random seed, and requests sharing a seed share a schedule.
"""
from __future__ import annotations

import bisect

from specdec.drafting.acceptance_rate import acceptance_rate_for

GOLDEN = (5 ** 0.5 - 1) / 2
_MASK = (1 << 64) - 1


def _unit_offset(key: int, seed: int) -> float:
    """A well-spread offset in [0, 1) per (key, seed): the splitmix64 finaliser of their combination."""
    z = (key * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class ForcedAcceptance:
    def __init__(self, mean_length: float, num_drafts: int, seed: int = 0, enabled: bool = False):
        if not enabled:
            raise PermissionError("forced acceptance changes the output and is for benchmarks only: "
                                  "enable it explicitly (--unsafe-forced-acceptance)")
        self.mean_length, self.num_drafts, self.seed = mean_length, num_drafts, seed
        self.rate = acceptance_rate_for(mean_length, num_drafts)
        self.thresholds = [1.0 - self.rate ** (j + 1) for j in range(num_drafts)]  # P(J <= j), increasing

    def count(self, key: int, index: int) -> int:
        """Accepted drafts at the `index`-th verify step of the sequence keyed `key` (its sampling seed)."""
        u = (_unit_offset(key, self.seed) + index * GOLDEN) % 1.0
        return bisect.bisect_right(self.thresholds, u)

    def draw(self, steps: list[tuple[int, int]]) -> list[int]:
        """Accepted count per (key, verify-step index) of this step's sequences."""
        return [self.count(key, index) for key, index in steps]
