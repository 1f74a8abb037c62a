"""The adaptive policy's rules for leaving the drafter (issue 41, draft_policy.py), on made-up step costs: a
sequence leaves when plain decoding beats every k by its estimate (by a margin that grows with the batch), once it
is judged or sooner when the rest of its probes could not save it; a step that verifies no drafts takes the judged
out; a young sequence probes at the best k >= 1, but not while prompts wait, and drafts nothing on its prior then.
The engine's side: test_leaving_the_drafter.py."""
import numpy as np
import pytest

from verifier_service.acceptance_stats import AcceptanceStats
from verifier_service.draft_policy import (EARLY_REJECTIONS, LEAVE_MARGIN, LEAVE_MARGIN_ALONE, MIN_OBSERVATIONS,
                                           DraftChoice, DraftPolicy, StepCosts)

pytestmark = pytest.mark.timeout(120)
K = 3


def stats_of(rate: float, observations: int) -> AcceptanceStats:
    """A sequence whose own record is `observations` per-token outcomes at acceptance `rate` (k = 3 steps)."""
    s = AcceptanceStats()
    hits = round(rate * observations)
    s.accepted, s.rejected_steps, s.verify_steps = hits, observations - hits, observations
    return s


def table(plain: float | None) -> StepCosts:
    """One batch size: k = 0 (the drafter catching up) 1.0, each draft +0.3; plain decoding `plain`."""
    return StepCosts((1,), np.array([[1.0, 1.3, 1.6, 1.9]]), plain=None if plain is None else np.array([plain]))


def test_a_sequence_leaves_when_plain_decoding_beats_every_k():
    """rate 0.2: E = 1, 1.2, 1.24, 1.25 tokens in 1.0 .. 1.9: at best 1.0 token per unit, against 1 / 0.8 plain;
    rate 0.95 keeps drafting (3.71 / 1.9 = 1.95)."""
    policy = DraftPolicy(K, True, table(0.8))
    good, bad = stats_of(0.95, 40), stats_of(0.2, 40)
    choice = policy.choose([good, bad, good], AcceptanceStats())
    assert choice.leaving == (1,) and choice.k == 3 and policy.num_left == 1
    assert DraftPolicy(K, True, table(0.8)).choose([good], AcceptanceStats()).leaving == ()
    # rate 0.5 (1.5 tokens in 1.3 at k = 1) leaves beside plain steps of 0.8 and stays beside steps of 1.15
    middling = stats_of(0.5, 40)
    assert DraftPolicy(K, True, table(0.8)).choose([middling], AcceptanceStats()).leaving == (0,)
    assert DraftPolicy(K, True, table(1.15)).choose([middling], AcceptanceStats()) == DraftChoice(1)


def test_a_near_tie_goes_to_plain_decoding():
    """Drafting 1% faster than plain decoding (within LEAVE_MARGIN): the sequence leaves."""
    bad = stats_of(0.2, 40)
    assert DraftPolicy(K, True, table(1.0 / 1.01)).choose([bad], AcceptanceStats()).leaving == (0,)


def test_a_sequence_is_judged_on_its_own_drafts():
    """It stays until it has MIN_OBSERVATIONS of its own (or EARLY_REJECTIONS rejections the rest could not make up
    for), and probes meanwhile: a step that would verify no drafts verifies some (here one: each draft costs as much
    as the one before; a new request is never locked out by the engine's rate)."""
    policy = DraftPolicy(K, True, table(0.8))
    good, young = stats_of(0.95, 40), stats_of(0.0, EARLY_REJECTIONS - 1)
    assert policy.choose([good, young], AcceptanceStats()) == DraftChoice(3)
    assert policy.choose([good, stats_of(0.0, MIN_OBSERVATIONS)], AcceptanceStats()).leaving == (1,)
    engine_bad = stats_of(0.0, 1000)
    assert DraftPolicy(K, True, table(0.8)).choose([AcceptanceStats()], engine_bad) == DraftChoice(1)
    assert DraftPolicy(K, True, table(0.8)).choose([young], engine_bad) == DraftChoice(1)
    seasoned = stats_of(0.0, MIN_OBSERVATIONS)
    assert DraftPolicy(K, True, table(0.8)).choose([seasoned], engine_bad) == DraftChoice(0, (0,))
    # a drafter that proposed nothing in 2 MIN_OBSERVATIONS verify steps: judged on the engine's rate, no probing
    dry = AcceptanceStats(verify_steps=2 * MIN_OBSERVATIONS - 1)
    assert DraftPolicy(K, True, table(0.8)).choose([dry], engine_bad) == DraftChoice(1)
    dry.verify_steps += 1
    assert DraftPolicy(K, True, table(0.8)).choose([dry], engine_bad) == DraftChoice(0, (0,))
    # without a plain column nobody leaves, and k = 0 stays k = 0
    assert DraftPolicy(K, True, table(None)).choose([young], engine_bad) == DraftChoice(0)


def test_a_sequence_the_rest_of_its_probes_cannot_save_leaves_early():
    """Before MIN_OBSERVATIONS a sequence leaves only when MIN_OBSERVATIONS would give it up whatever its next
    outcomes are: for every record of fewer observations and every way of completing it to exactly
    MIN_OBSERVATIONS, leaving early implies leaving then (a step of several accepted drafts can overshoot it: not
    covered), and all failures leave before MIN_OBSERVATIONS (on a bad engine rate after EARLY_REJECTIONS; on the
    prior 0.5 later)."""
    costs = table(0.8)
    first_exit = {}
    for engine in (AcceptanceStats(), stats_of(0.0, 1000), stats_of(0.5, 1000)):
        for seen in range(MIN_OBSERVATIONS):
            for hits in range(seen + 1):
                early = DraftPolicy(K, True, costs).choose([acceptance(hits, seen)], engine).leaving == (0,)
                if not early:
                    continue
                for more in range(MIN_OBSERVATIONS - seen + 1):
                    judged = acceptance(hits + more, MIN_OBSERVATIONS)
                    assert DraftPolicy(K, True, costs).choose([judged], engine).leaving == (0,), (hits, seen, more)
        first_exit[engine.accepted] = next(seen for seen in range(MIN_OBSERVATIONS + 1) if DraftPolicy(
            K, True, costs).choose([acceptance(0, seen)], engine).leaving == (0,))
    # never on the engine's rate alone: EARLY_REJECTIONS of its own first (then at once on a bad engine rate)
    assert first_exit[0] == EARLY_REJECTIONS < MIN_OBSERVATIONS
    assert EARLY_REJECTIONS <= first_exit[500] < MIN_OBSERVATIONS


def acceptance(hits: int, observations: int) -> AcceptanceStats:
    return AcceptanceStats(verify_steps=observations, accepted=hits, rejected_steps=observations - hits)


def test_a_step_without_drafts_takes_the_judged_out_of_the_drafter():
    """Four judged sequences whose own line says stay (rate 0.59: a batch like them makes 1.47x plain's tokens per
    second) beside 12 that left, with a drafter of host tokens: one draft would make the whole step synchronous, so
    the step verifies none, and they leave with it instead of staying at k = 0 for good. A step that probes for a
    young sequence verifies drafts after all (the best k >= 1: here 3, drafts nearly free once the drafter is
    asked): then nobody leaves, whatever the priced k was."""
    costs = StepCosts((16,), np.array([[5.0, 7.1, 7.2, 7.3]]), plain=np.array([5.0]))
    judged, young = stats_of(0.6, 40), stats_of(0.6, 1)
    assert DraftPolicy(K, True, costs).choose([judged] * 16, AcceptanceStats()) == DraftChoice(3)
    choice = DraftPolicy(K, True, costs).choose([judged] * 4, AcceptanceStats(), opted_out=12, proportional=False)
    assert choice == DraftChoice(0, (0, 1, 2, 3))
    choice = DraftPolicy(K, True, costs).choose([judged, young], AcceptanceStats(), opted_out=14, proportional=False)
    assert choice == DraftChoice(3)
    # a good judged sequence beside young ones priced on a bad engine rate: their probe keeps it in
    flat = StepCosts((11,), np.array([[1.0, 1.3, 1.6, 1.9]]), plain=np.array([0.95]))
    good = acceptance(28, 40)                                    # 0.7
    choice = DraftPolicy(K, True, flat).choose([good] + [AcceptanceStats()] * 10, acceptance(10, 100))
    assert choice.k >= 1 and choice.leaving == ()


def test_a_probe_waits_while_prompts_wait_for_up_to_min_observations_steps():
    """A young sequence whose estimate says k = 0 probes (here with one draft), unless prompts wait to be prefilled
    (its rows would take their budget); after MIN_OBSERVATIONS verify steps of waiting it probes anyway."""
    engine_bad = stats_of(0.0, 1000)
    young = stats_of(0.0, EARLY_REJECTIONS - 1)
    assert DraftPolicy(K, True, table(0.8)).choose([young], engine_bad) == DraftChoice(1)
    assert DraftPolicy(K, True, table(0.8)).choose([young], engine_bad, prompts_waiting=True) == DraftChoice(0)
    waited = AcceptanceStats(verify_steps=MIN_OBSERVATIONS)
    assert DraftPolicy(K, True, table(0.8)).choose([waited], engine_bad, prompts_waiting=True) == DraftChoice(1)


def test_while_prompts_wait_the_young_draft_nothing_on_their_prior():
    """A good engine rate makes k = 3 pay for young sequences; while prompts wait to be prefilled a step of only
    them verifies none (their drafts would take the waiting prompts' place), unless they have waited
    MIN_OBSERVATIONS steps; beside judged sequences the step is priced as ever (k is one number for the step: the
    young verify its k), and waiting never takes the judged out of the drafter."""
    engine_good = stats_of(0.9, 1000)
    young = [AcceptanceStats(verify_steps=2)] * 3
    assert DraftPolicy(K, True, table(0.8)).choose(young, engine_good) == DraftChoice(3)
    assert DraftPolicy(K, True, table(0.8)).choose(young, engine_good, prompts_waiting=True) == DraftChoice(0)
    waited = [AcceptanceStats(verify_steps=MIN_OBSERVATIONS)] * 3
    assert DraftPolicy(K, True, table(0.8)).choose(waited, engine_good, prompts_waiting=True) == DraftChoice(3)
    good = stats_of(0.95, 40)
    assert DraftPolicy(K, True, table(0.8)).choose([good] + young, engine_good, prompts_waiting=True).k == 3
    # judged sequences whose own line says stay, beside young ones, with a drafter priced whole: they keep drafting
    costs = StepCosts((16,), np.array([[5.0, 7.1, 7.2, 7.3]]), plain=np.array([5.0]))
    beside = [stats_of(0.6, 40)] * 4 + [AcceptanceStats(verify_steps=1)] * 12
    assert DraftPolicy(K, True, costs).choose(beside, AcceptanceStats(), prompts_waiting=True,
                                              proportional=False) == DraftChoice(3)
    # without a plain column nobody leaves or probes: the prior prices k as before
    assert DraftPolicy(K, True, table(None)).choose(young, engine_good, prompts_waiting=True) == DraftChoice(3)


def test_a_probe_verifies_the_best_k_of_at_least_one():
    """A young sequence's probe verifies the k >= 1 of the most expected tokens per second: one draft where each
    costs as much as above (table: +0.3 per draft, rate 0), all three where the drafter's call is the cost and
    drafts are nearly free."""
    engine_bad, young = stats_of(0.0, 1000), AcceptanceStats(verify_steps=1)
    assert DraftPolicy(K, True, table(0.8)).choose([young], engine_bad) == DraftChoice(1)
    flat = StepCosts((1,), np.array([[1.0, 1.6, 1.61, 1.62]]), plain=np.array([1.0]))
    assert DraftPolicy(K, True, flat).choose([young], stats_of(0.3, 1000)) == DraftChoice(3)


def test_the_margin_to_stay_grows_with_the_batch():
    """Drafting 5% faster than plain decoding keeps a sequence alone in the drafter (margin LEAVE_MARGIN_ALONE) and
    takes it out of a batch of 16 (margin near LEAVE_MARGIN)."""
    rate = 0.5                                   # E(0.5, 3) = 1.875 tokens
    for batch, leaves in ((1, False), (16, True)):
        plain = 1.05 * 1.9 / 1.875               # k = 3: 1.875 tokens in 1.9, 5% more than plain's one in `plain`
        costs = StepCosts((batch,), np.array([[max(1.0, plain), 1.8, 1.85, 1.9]]), plain=np.array([plain]))
        choice = DraftPolicy(K, True, costs).choose([stats_of(rate, 40)] * batch, AcceptanceStats())
        assert bool(choice.leaving) == leaves, batch
    assert LEAVE_MARGIN_ALONE < 0.05 < LEAVE_MARGIN * 15 / 16


def test_a_step_is_priced_for_the_sequences_in_the_drafter():
    """One sequence in the drafter beside 63 out of it: its drafts cost 1/64 of the table's extra step time, so
    it drafts (k = 3) where a whole batch of it would take one draft; without a plain column, or with a drafter
    of host tokens or replayed CUDA graphs (not proportional), the whole step's cost counts (k = 0; a probe while it
    is unjudged, here of one draft)."""
    costs = StepCosts((64,), np.array([[8.2, 10.0, 12.0, 14.0]]), plain=np.array([7.4]))
    engine = stats_of(0.35, 100)                     # a new sequence's estimate: the engine's rate, about 0.36
    newcomer = AcceptanceStats()
    assert DraftPolicy(K, True, costs).choose([newcomer], engine, opted_out=63) == DraftChoice(3)
    assert DraftPolicy(K, True, costs).choose([newcomer] * 64, engine).k == 1     # 1.36 tokens in 10 beats 1 in 8.2
    unpriced = StepCosts((64,), costs.seconds)
    assert DraftPolicy(K, True, unpriced).choose([newcomer], engine, opted_out=63) == DraftChoice(0)
    # a drafter of host tokens: one sequence in it makes the whole step synchronous, priced as such
    assert DraftPolicy(K, True, costs).choose([newcomer], engine, opted_out=63, proportional=False) == DraftChoice(1)


def test_without_a_plain_cost_or_with_the_fixed_policy_nobody_leaves():
    bad = stats_of(0.0, 100)
    assert DraftPolicy(K, True, table(None)).choose([bad], AcceptanceStats()).leaving == ()
    assert DraftPolicy(K, False, table(0.5)).choose([bad], AcceptanceStats()) == DraftChoice(K)


def test_the_batch_size_decides_who_leaves():
    """The same acceptance drafts at batch 1 (drafts ride along) and leaves at batch 64 (they cost a step's
    worth of rows)."""
    costs = StepCosts((1, 64), np.array([[1.0, 1.02, 1.04, 1.06], [1.2, 1.9, 2.8, 3.7]]), plain=np.array([0.98, 1.0]))
    seqs = [stats_of(0.4, 40)] * 64
    assert DraftPolicy(K, True, costs).choose(seqs[:1], AcceptanceStats()) == DraftChoice(3)
    assert DraftPolicy(K, True, costs).choose(seqs, AcceptanceStats()) == DraftChoice(0, tuple(range(64)))
