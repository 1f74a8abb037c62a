"""How many drafts each step verifies: a fixed k, or the k that maximises expected tokens per second.

Adaptive rule, per step, for the B sequences that decode (those out of the drafter, opted out with
`speculation: false` or given up on as below, verify none and count as one token):

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

When the costs hold a plain column P(B) (below), a step with d of its B sequences in the drafter is priced
between the two, P(B) + (d / B) (T(B, k) - P(B)), when its cost is proportional: the drafter's rows and the drafts
grow with the sequences in it (a drafter that drafts on the device, steps run eagerly). A drafter of host tokens
makes a step that asks it synchronous for the whole batch, and a verify step replayed from a CUDA graph pads every
sequence to 1 + K tokens once one verifies drafts: such a step costs about T(B, k) whatever d is.

"recent": each new observation weighs the engine's earlier ones RECENT_DECAY times, a step's own observations
counted whole (the rate of about the last max(1 / (1 - RECENT_DECAY), one step's) draft tokens judged: at c64 the
last step or so). Steps that verify nothing leave it as it was, so that requests admitted
after a long run of k = 0 (or after the drafter had nobody to draft for) start from the rate the engine last saw,
not from p0. Without a plain column (nobody leaves, below), a run of EXPLORE_EVERY steps chosen k = 0 is followed
by EXPLORE_STEPS steps of one draft (a drafter drafts for the step after the one that asks, and a drafter of host
tokens skipped at k = 0 is asked again only after a synchronous step: one step would verify nothing), so that
estimates that fell too low can recover. The choice changes only how many drafts are verified, never which tokens
are emitted: speculation stays lossless. A settled choice (k = K, every sequence judged, none leaving) stands for
the next REUSE_STEPS - 1 steps of the same batch (as many sequences in the drafter and out of it), which are not
priced again (a step's host time is the critical path of a synchronous drafter): a sequence that should leave
leaves up to REUSE_STEPS - 1 steps later, and the engine's rate takes those steps' observations at once.

Giving up (when the costs hold a plain column, P(B): a step of B sequences none of which is in the drafter): a
sequence leaves the drafter for good when, by its estimate, a batch of B sequences like it would decode faster
without the drafter than with it at any k, or nearly,

    max over k of E(a_i, k) / T(B, k)  <  (1 + m(B)) / P(B),
    m(B) = LEAVE_MARGIN - (LEAVE_MARGIN - LEAVE_MARGIN_ALONE) / B

once it has MIN_OBSERVATIONS of its own (or 2 MIN_OBSERVATIONS verify steps: a drafter that proposes nothing for
it, an n-gram one without a match, teaches nothing), or sooner, once its drafts were rejected EARLY_REJECTIONS
times, when the rest of them cannot save it: even if every observation it lacks of MIN_OBSERVATIONS were a success,
its estimate would still be under the line (judged at exactly MIN_OBSERVATIONS it would leave whatever they are;
a step of several accepted drafts can carry it past MIN_OBSERVATIONS with more successes than that, so the early
exit is slightly stricter than waiting). A step that verifies no drafts after all (its priced k, the probe below and
the exploring above taken into account) takes every judged sequence out with it: staying would gain them nothing (a
sequence the batch's economics keep at k = 0 while its own line says stay, beside others that left, would
otherwise stay for good, its drafter's host work paid every step). Until it is judged a sequence probes: a step
with such a sequence in the drafter that is priced k = 0 verifies the best k >= 1 by the same pricing instead (k = 0
would teach it nothing while the drafter still catches up on it; where asking the drafter is most of a draft's
cost, that is K, and more observations a step), so that a new request is judged on its own drafts, never locked
out by the engine's rate. While prompts wait to be prefilled (more prompt tokens are left than the step's token
budget, the decoders' own tokens not counted: a burst of requests being admitted, a long prompt's chunks) a young
sequence waits, for up to MIN_OBSERVATIONS steps: it does not probe, and a step whose sequences in
the drafter all wait verifies none (k is one number for the step: beside judged ones it verifies their k). Drafts
on its prior would take the waiting prompts' place in the step's token budget and lengthen the step, which delays
their first tokens and the whole batch after them (beside a drafter of host tokens they would also make the step
synchronous). Prompts whose tokens left the budget holds (a burst's last ones) do not make it wait: its drafts
may push part of a prompt into the next step, but waiting there would also skip the drafter, and the young would
verify no drafts in the next step either (at 16 sequences of 128-token prompts: 3 more steps for the batch). A
sequence out of the drafter costs it nothing: no rows to catch up on, no drafts; while no sequence is in the
drafter, steps verify none (engine.py) and do not call it. It does not come back (a drafter that takes hidden
states would have to see its whole context again); requests admitted later start in the drafter, their prior
taken from the engine's recent rate.
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
RECENT_DECAY = 0.98         # the engine-wide rate forgets old observations (about the last 50, or a step's)
MIN_OBSERVATIONS = 8        # a sequence's own observations before it may leave the drafter but for an early exit
EARLY_REJECTIONS = 2        # its own rejections before it may leave sooner (never on the engine's rate alone)
REUSE_STEPS = 8             # steps a settled choice stands for the same batch (one priced, seven not)
# It leaves unless the drafter beats plain decoding by m(B) (the module docstring). A near tie goes to plain decoding:
# the costs are measured to a few percent, and what a sequence gains by staying it gains alone (it finishes
# sooner), while the other B - 1 sequences' steps pay for its drafts: the margin grows with them, from
# LEAVE_MARGIN_ALONE for a sequence alone to LEAVE_MARGIN.
LEAVE_MARGIN_ALONE = 0.02
LEAVE_MARGIN = 0.10


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step: seconds[i, k] for batch_sizes[i] decoding sequences verifying k drafts each, and
    plain[i] for as many sequences out of the drafter."""
    batch_sizes: tuple[int, ...]          # increasing
    seconds: np.ndarray                   # [len(batch_sizes), K + 1]
    drafts: np.ndarray | None = None      # [len(batch_sizes), K + 1] drafts a verify step really had while timed
    plain: np.ndarray | None = None       # [len(batch_sizes)] no sequence in the drafter (None: not measured)

    def at(self, batch: int) -> np.ndarray:
        """[K + 1] seconds per step for `batch` sequences: linear between measured sizes, beyond the largest
        scaled with the batch (a step that large is throughput-bound)."""
        return self._interpolated(self.seconds, batch)

    def plain_at(self, batch: int) -> float | None:
        """Seconds per step of `batch` sequences none of which is in the drafter (None: not measured)."""
        return None if self.plain is None else float(self._interpolated(self.plain, batch))

    def _interpolated(self, values: np.ndarray, batch: int) -> np.ndarray:
        sizes = self.batch_sizes
        if batch <= sizes[0]:
            return values[0]
        if batch >= sizes[-1]:
            return values[-1] * (batch / sizes[-1])
        hi = bisect.bisect_left(sizes, batch)
        lo = hi - 1
        w = (batch - sizes[lo]) / (sizes[hi] - sizes[lo])
        return values[lo] * (1 - w) + values[hi] * w

    def table(self) -> str:
        """The table as the start-up log prints it: ms per step (and the drafts a verify step had, when known)."""
        head = "batch " + " ".join(f"k={k:<5d}" for k in range(self.seconds.shape[1])) + " plain"
        drafts = self.drafts if self.drafts is not None else np.full_like(self.seconds, np.nan)
        plain = self.plain if self.plain is not None else np.full(len(self.batch_sizes), np.nan)
        rows = [f"{b:5d} " + " ".join(f"{t * 1e3:7.2f}" for t in row) + f" {p * 1e3:7.2f}   drafts "
                + " ".join(f"{d:.2f}" for d in dr)
                for b, row, p, dr in zip(self.batch_sizes, self.seconds, plain, drafts)]
        return "\n".join([head] + rows)


@dataclass(frozen=True)
class Estimates:
    """A step's view of the B sequences in the drafter (the module docstring)."""
    rates: np.ndarray      # [B] shrunk per-token acceptance a_i
    judged: np.ndarray     # [B] seen enough to be judged on it
    hopeful: np.ndarray    # [B] a_i if every observation it lacks of MIN_OBSERVATIONS were a success (1: may not
    #                        leave early, fewer than EARLY_REJECTIONS rejections of its own)
    steps: np.ndarray      # [B] its verify steps (drafts or none)


@dataclass
class SettledChoice:
    """A settled choice (k = K, every sequence judged, none leaving) and the steps of its batch it still stands."""
    batch_shape: tuple[int, int, bool]     # (sequences in the drafter, out of it, proportional)
    k: int
    steps_left: int


@dataclass(frozen=True)
class DraftChoice:
    """A step's choice: the drafts each sequence in the drafter verifies, and the sequences (places in the list
    given to `choose`) that leave the drafter now."""
    k: int
    leaving: tuple[int, ...] = ()


def acceptance_rate(stats: AcceptanceStats) -> tuple[float, float]:
    """(successes, observations) of the per-token acceptance in `stats` (see the module docstring)."""
    return float(stats.accepted), float(stats.accepted + stats.rejected_steps)


def expected_tokens(rates: np.ndarray, max_drafts: int) -> np.ndarray:
    """[B, K + 1] E(a_i, k) = sum_{j <= k} a_i^j."""
    powers = rates[:, None] ** np.arange(max_drafts + 1)[None, :]
    return np.cumsum(powers, axis=1)


class DraftPolicy:
    """`choose` gives a step's DraftChoice: k = `max_drafts` when fixed (or before costs are measured), else the
    adaptive rule and the sequences it gives up on. `chosen` counts steps by the k they were given and `num_left`
    the sequences given up on (the metrics' and the bench's view)."""

    def __init__(self, max_drafts: int, adaptive: bool, costs: StepCosts | None = None):
        self.max_drafts, self.adaptive, self.costs = max_drafts, adaptive, costs
        self.chosen = [0] * (max_drafts + 1)
        self.num_left = 0                 # sequences that left the drafter
        self._zeros = 0                   # steps chosen k = 0 in a row
        self._exploring = 0               # exploring steps left
        self._recent = np.zeros(2)        # the engine's decayed (successes, observations)
        self._counted = np.zeros(2)       # the engine's totals at the last step
        self._settled: SettledChoice | None = None

    def choose(self, seq_stats: list[AcceptanceStats], engine_stats: AcceptanceStats, opted_out: int = 0,
               proportional: bool = True, prompts_waiting: bool = False) -> DraftChoice:
        """The choice for a step of len(seq_stats) decoding sequences in the drafter and `opted_out` out of it;
        `proportional`: its cost grows with the sequences in the drafter; `prompts_waiting`: prompts wait to be
        prefilled, so young sequences wait (the module docstring)."""
        choice = self._choose(seq_stats, engine_stats, opted_out, proportional, prompts_waiting)
        self.chosen[choice.k] += 1
        self.num_left += len(choice.leaving)
        return choice

    def _choose(self, seq_stats: list[AcceptanceStats], engine_stats: AcceptanceStats, opted_out: int,
                proportional: bool, prompts_waiting: bool) -> DraftChoice:
        if not self.adaptive or self.costs is None or self.max_drafts == 0:
            return DraftChoice(self.max_drafts)
        if not seq_stats:
            return DraftChoice(0)
        batch_shape = (len(seq_stats), opted_out, proportional)
        if self._settled is not None and self._settled.batch_shape == batch_shape and self._settled.steps_left:
            self._settled.steps_left -= 1
            return DraftChoice(self._settled.k)
        self._settled = None
        est = self._estimates(seq_stats, engine_stats)
        top = min(self.max_drafts, self.costs.seconds.shape[1] - 1)   # the table's K (a drafter's k may be lower)
        batch = len(seq_stats) + opted_out
        seconds = self.costs.at(batch)[:top + 1]                                         # [K + 1]
        expected = expected_tokens(est.rates, top)                                       # [B, K + 1]
        plain = self.costs.plain_at(batch)
        blend = plain if proportional else None
        leaving = self._leaving(expected, est.judged, expected_tokens(est.hopeful, top), seconds, plain, batch)
        stay = np.ones(len(seq_stats), dtype=bool)                                       # [B]
        stay[leaving] = False
        if not stay.any():
            return DraftChoice(0, tuple(leaving.tolist()))
        young = stay & ~est.judged                                                       # [B]
        # while prompts wait to be prefilled, a young sequence waits (for up to MIN_OBSERVATIONS steps): a step of
        # only such sequences verifies none, and none of them probes
        waiting = young & (est.steps < MIN_OBSERVATIONS) & (prompts_waiting and plain is not None)    # [B]
        num_plain = opted_out + leaving.size
        k = 0 if (waiting == stay).all() else _best_k(expected[stay], num_plain, seconds, blend)
        if k == 0 and plain is not None and (young & ~waiting).any():   # a young sequence probes: the best k >= 1
            k = _best_k(expected[stay], num_plain, seconds, blend, least=1)
        k = self._explored(k)
        if k == 0 and plain is not None:    # no drafts this step: the judged gain nothing by staying, and leave
            stay &= ~est.judged
            leaving = np.flatnonzero(~stay)
        if k == top and not leaving.size and est.judged.all():
            self._settled = SettledChoice(batch_shape, k, REUSE_STEPS - 1)
        return DraftChoice(k, tuple(leaving.tolist()))

    def _estimates(self, seq_stats: list[AcceptanceStats], engine_stats: AcceptanceStats) -> Estimates:
        """The sequences' acceptance estimates (the module docstring), the engine's recent rate updated first."""
        total = np.array(acceptance_rate(engine_stats))
        if (total < self._counted).any():   # the engine's counters started afresh (after the warm-up)
            self._counted = np.zeros(2)
        new = total - self._counted                                                     # (successes, observations)
        self._recent = self._recent * RECENT_DECAY ** new[1] + new
        self._counted = total
        hits, seen = self._recent
        prior = (hits + PRIOR_WEIGHT * PRIOR_RATE) / (seen + PRIOR_WEIGHT)
        counts = np.array([(s.accepted, s.rejected_steps, s.verify_steps) for s in seq_stats],
                          np.float64).reshape(-1, 3)                                                           # [B, 3]
        accepted, observed, steps = counts[:, 0], counts[:, 0] + counts[:, 1], counts[:, 2]            # [B] each
        rates = np.clip((accepted + PRIOR_WEIGHT * prior) / (observed + PRIOR_WEIGHT), 0.0, 0.999)    # [B]
        lacking = np.maximum(MIN_OBSERVATIONS - observed, 0.0)                                          # [B]
        hopeful = np.clip((accepted + lacking + PRIOR_WEIGHT * prior) / (observed + lacking + PRIOR_WEIGHT),
                          0.0, 0.999)                                                                   # [B]
        hopeful[observed - accepted < EARLY_REJECTIONS] = 1.0      # too few rejections of its own to leave early
        return Estimates(rates, (observed >= MIN_OBSERVATIONS) | (steps >= 2 * MIN_OBSERVATIONS), hopeful, steps)

    @staticmethod
    def _leaving(expected: np.ndarray, judged: np.ndarray, hopeful: np.ndarray, seconds: np.ndarray,
                 plain: float | None, batch: int) -> np.ndarray:
        """Places of the sequences that leave the drafter (the module docstring's rule): judged and under the line,
        or under it even at their hopeful estimates; none without a plain cost."""
        if plain is None:
            return np.zeros(0, dtype=np.int64)

        def under(tokens: np.ndarray) -> np.ndarray:                                     # [B, K + 1] -> [B]
            margin = LEAVE_MARGIN - (LEAVE_MARGIN - LEAVE_MARGIN_ALONE) / batch
            return (tokens / seconds[None, :]).max(axis=1) * plain < 1 + margin
        return np.flatnonzero((under(expected) & judged) | under(hopeful))

    def _explored(self, k: int) -> int:
        """k, or one draft while exploring after a long run of k = 0."""
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
        self.chosen, self.num_left = [0] * (self.max_drafts + 1), 0
        self._zeros, self._exploring, self._recent, self._counted = 0, 0, np.zeros(2), np.zeros(2)
        self._settled = None


def _best_k(expected: np.ndarray, num_plain: int, seconds: np.ndarray, plain: float | None, least: int = 0) -> int:
    """argmax over k >= least of (sum_i E(a_i, k) + num_plain) / T(B, k), T priced for the sequences in the
    drafter when the plain cost is known; K unless another k beats it by MARGIN."""
    if plain is not None:
        seconds = plain + len(expected) / (len(expected) + num_plain) * (seconds - plain)
    rate = (expected.sum(axis=0) + num_plain) / seconds                                  # [K + 1] tokens per second
    k = least + int(np.argmax(rate[least:]))
    return k if rate[k] >= rate[-1] * (1 + MARGIN) else len(rate) - 1
