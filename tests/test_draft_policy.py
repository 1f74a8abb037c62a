"""The draft policy (issue 41): the adaptive rule picks the k that maximises expected tokens per second from the
measured step costs and each sequence's acceptance; the choice changes only speed (outputs equal plain decoding
whatever k each step gets, on overlapped and synchronous steps); a request with `speculation: false` verifies no
drafts beside others that do; the start-up measurement fills the cost table through the real engine."""
import itertools

import numpy as np
import pytest
from engine_factory import make_drafter, make_engine, random_prompts
from test_overlapped_steps import run

from specdec.sampling_params import SamplingParams
from verifier_service.acceptance_stats import AcceptanceStats
from verifier_service.draft_policy import (EXPLORE_EVERY, EXPLORE_STEPS, MIN_OBSERVATIONS, REUSE_STEPS, DraftChoice,
                                           DraftPolicy, StepCosts, expected_tokens)
from verifier_service.warm_up import measure_step_costs

pytestmark = pytest.mark.timeout(300)
K = 3


def stats_with(rate_hits: int, rate_misses: int) -> AcceptanceStats:
    """A sequence that accepted `rate_hits` drafts over verify steps ending in `rate_misses` rejections."""
    s = AcceptanceStats()
    for _ in range(rate_misses):
        s.record(K, 0, 1)
    for _ in range(rate_hits // K):
        s.record(K, K, K + 1)
    return s


def costs(*per_k_by_batch) -> StepCosts:
    sizes = tuple(2 ** i for i in range(len(per_k_by_batch)))
    return StepCosts(sizes, np.array(per_k_by_batch, dtype=float))


def test_a_settled_choice_stands_for_the_same_batch_only():
    """k = K for judged sequences none of which leaves stands REUSE_STEPS steps of the same batch without being
    priced again (a sequence whose drafts start failing meanwhile is seen at the next priced step); a batch of
    another shape, or a choice below K, is priced at once."""
    steep = costs([1.0, 1.6, 2.2, 2.8])
    good, bad = stats_with(300, 10), stats_with(0, 100)
    engine = AcceptanceStats()
    policy = DraftPolicy(K, True, steep)
    assert policy.choose([good], engine).k == K
    for _ in range(REUSE_STEPS - 1):                       # not priced: the bad record is not looked at
        assert policy.choose([bad], engine).k == K
    assert policy.choose([bad], engine).k == 0             # priced again
    assert policy.choose([bad], engine).k == 0             # k < K: priced every step
    assert policy.choose([good], engine).k == K
    policy = DraftPolicy(K, True, steep)
    assert policy.choose([good], engine).k == K
    assert policy.choose([bad], engine, opted_out=1).k == 0   # another batch: priced
    assert policy.choose([good], engine).k == K                 # settled again
    policy.forget()                                             # forgets it: the next step is priced
    assert policy.choose([bad], engine).k == 0
    policy = DraftPolicy(K, True, costs([1.0, 1.1, 1.2, 1.3]))  # a young sequence keeps every step priced
    assert policy.choose([AcceptanceStats()], engine).k == K
    assert policy.choose([bad], engine).k == 0


def test_acceptance_estimate_counts_a_rejection_per_step_that_did_not_accept_all():
    s = AcceptanceStats()
    s.record(3, 3, 4)      # 3 successes
    s.record(3, 1, 2)      # 1 success, 1 failure
    s.record(2, 0, 1)      # 1 failure
    s.record(0, 0, 1)      # nothing learnt
    assert (s.accepted, s.rejected_steps) == (4, 2)


def test_expected_tokens_is_the_truncated_geometric_sum():
    e = expected_tokens(np.array([0.0, 0.5, 1.0]), 3)
    assert e.tolist() == [[1, 1, 1, 1], [1, 1.5, 1.75, 1.875], [1, 2, 3, 4]]


def test_adaptive_picks_the_k_of_most_tokens_per_second():
    engine = AcceptanceStats()
    flat = costs([1.0, 1.0, 1.0, 1.0])                     # drafts cost nothing: the longest pays
    steep = costs([1.0, 1.6, 2.2, 2.8])                     # each draft costs 60% of a step
    good, bad = stats_with(300, 10), stats_with(0, 100)     # rates ~0.97 and 0
    assert DraftPolicy(K, True, flat).choose([good], engine).k == 3
    assert DraftPolicy(K, True, steep).choose([bad], engine).k == 0
    assert DraftPolicy(K, True, steep).choose([good], engine).k == 3   # 4 tokens / 2.8 beats 1 / 1.0
    middle = stats_with(90, 100)                             # rate 0.47: E = 1, 1.47, 1.69, 1.80
    assert DraftPolicy(K, True, costs([1.0, 1.2, 1.5, 1.8])).choose([middle], engine).k == 1
    # the fixed policy, and an adaptive one before its costs are measured, give k
    assert DraftPolicy(K, False, steep).choose([bad], engine).k == 3
    assert DraftPolicy(K, True, None).choose([bad], engine).k == 3


def test_a_near_tie_keeps_k():
    """Costs set so that k = 2 gives 1% more tokens per second than k = 3: within the costs' noise, K stays; 20%
    more: k = 2."""
    seqs = [stats_with(3000, 7000)]                               # a = 0.3 (the prior barely moves it)
    e = expected_tokens(np.array([0.3]), K)[0]                    # 1, 1.3, 1.39, 1.417

    def table(gain):                                              # tokens per second 0.5, 0.5, gain, 1
        return costs([e[0] / 0.5, e[1] / 0.5, e[2] / gain, e[3] / 1.0])
    assert DraftPolicy(K, True, table(1.01)).choose(seqs, AcceptanceStats()).k == 3
    assert DraftPolicy(K, True, table(1.2)).choose(seqs, AcceptanceStats()).k == 2


def test_a_table_measured_with_fewer_drafts_than_the_policy_allows_is_used_up_to_its_k():
    """A drafter with k = 2 behind a verifier configured for 3: the table has columns 0..2, and the rule picks
    among them (it raised on the mismatched shapes before)."""
    table = costs([1.0, 1.05, 1.1])
    assert DraftPolicy(K, True, table).choose([stats_with(300, 10)], AcceptanceStats()).k == 2


def test_cost_table_interpolates_between_batches_and_scales_beyond():
    c = StepCosts((1, 4), np.array([[1.0, 2.0], [4.0, 8.0]]))
    assert c.at(1).tolist() == [1.0, 2.0] and c.at(4).tolist() == [4.0, 8.0]
    assert c.at(2).tolist() == [2.0, 4.0] and c.at(8).tolist() == [8.0, 16.0]


def test_the_batch_size_decides_between_two_costs_of_the_same_acceptance():
    """Small batches: drafts ride along almost free; large batches: a step's cost grows with its tokens."""
    table = StepCosts((1, 64), np.array([[1.0, 1.02, 1.04, 1.06], [1.0, 1.9, 2.8, 3.7]]))
    seqs = [stats_with(60, 40)] * 64                          # rate 0.6
    policy = DraftPolicy(K, True, table)
    assert policy.choose(seqs[:1], AcceptanceStats()).k == 3
    assert policy.choose(seqs, AcceptanceStats()).k == 0
    assert policy.chosen == [1, 0, 0, 1]


def test_a_new_sequence_takes_the_engine_rate_and_opted_out_ones_count_as_one_token():
    table = costs([1.0, 1.3, 1.6, 1.9])
    engine_good, engine_bad = stats_with(300, 10), stats_with(0, 100)
    new = AcceptanceStats()
    assert DraftPolicy(K, True, table).choose([new], engine_good).k == 3
    assert DraftPolicy(K, True, table).choose([new], engine_bad).k == 0
    # one speculating sequence of rate ~0.97 beside 30 that opted out: the 30 gain nothing from drafts
    wide = StepCosts((1, 32), np.array([[1.0, 1.3, 1.6, 1.9], [1.0, 1.3, 1.6, 1.9]]))
    assert DraftPolicy(K, True, wide).choose([engine_good], engine_good, opted_out=30).k == 0
    assert DraftPolicy(K, True, wide).choose([engine_good], engine_good, opted_out=0).k == 3


def test_the_engine_rate_holds_through_steps_that_verify_nothing():
    """The engine-wide rate forgets observations as new ones come, not steps: after a long run of k = 0 (every
    sequence out of the drafter, or none decoding) a new request still starts from the low rate the engine last
    saw, and probes with one draft instead of verifying k."""
    table = costs([1.0, 1.1, 1.2, 1.3])
    policy, engine = DraftPolicy(K, True, table), stats_with(0, 100)
    assert policy.choose([AcceptanceStats()], engine).k == 0          # a new request at a bad engine rate
    for _ in range(500):                                              # nothing verified: the counts stand still
        policy.choose([], engine)
        policy.choose([stats_with(0, 2 * MIN_OBSERVATIONS)], engine)  # judged, so no probe: k = 0
    assert policy.choose([AcceptanceStats()], engine).k == 0
    fresh = DraftPolicy(K, True, table)
    assert fresh.choose([AcceptanceStats()], AcceptanceStats()).k == 3    # p0 = 0.5 with nothing seen: k = 3
    # new observations still move it: the engine accepts everything from now on
    good = stats_with(0, 100)
    for _ in range(40):
        good.record(K, K, K + 1)
        policy.choose([stats_with(30, 0)], good)
    assert policy.choose([AcceptanceStats()], good).k == 3


def test_k_zero_explores_one_draft_now_and_then():
    policy = DraftPolicy(K, True, costs([1.0, 5.0, 9.0, 13.0]))
    chosen = [policy.choose([AcceptanceStats()], AcceptanceStats()).k for _ in range(2 * EXPLORE_EVERY)]
    assert chosen[EXPLORE_EVERY - 1:EXPLORE_EVERY - 1 + EXPLORE_STEPS] == [1] * EXPLORE_STEPS
    assert chosen.count(1) == EXPLORE_STEPS and set(chosen) == {0, 1}


@pytest.fixture(scope="module")
def demo():
    from specdec.demo import demo_model_dir
    from specdec.models.loader import load_model
    return load_model(demo_model_dir())


def requests(prompts, temperature=0.0):
    return {f"r{i}": (p, SamplingParams(max_tokens=20 + 3 * i, temperature=temperature, top_p=0.9, seed=i,
                                        ignore_eos=True)) for i, p in enumerate(prompts)}


@pytest.mark.parametrize("kind", ["mtp", "ngram"])   # overlapped steps (drafts on the device) and synchronous ones
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_any_k_per_step_gives_the_plain_output(demo, kind, temperature):
    prompts = random_prompts([5, 9, 14, 7], demo.config.vocab_size, seed=3)
    plain = run(make_engine(demo, overlap=False), requests(prompts, temperature))
    engine = make_engine(demo, make_drafter(kind, demo, K), k=K)
    cycle = itertools.cycle([3, 0, 2, 1, 1, 3, 0])
    engine.policy.choose = lambda *args, **kwargs: DraftChoice(next(cycle))
    assert run(engine, requests(prompts, temperature)) == plain
    assert 0 < engine.stats.drafted < K * engine.stats.verify_steps   # fewer drafts than k = 3 throughout


def test_speculation_false_verifies_no_drafts_beside_requests_that_do(demo):
    prompts = random_prompts([6, 11, 8], demo.config.vocab_size, seed=5)
    plain = run(make_engine(demo, overlap=False), requests(prompts))
    for kind in ("mtp", "ngram"):
        engine = make_engine(demo, make_drafter(kind, demo, K), k=K)
        reqs = requests(prompts)
        prompt, params = reqs["r1"]
        reqs["r1"] = (prompt, SamplingParams(**{**params.__dict__, "speculation": False}))
        seen = {}
        add = engine.add_request

        def spy(rid, prompt_ids, sampling):
            add(rid, prompt_ids, sampling)
            seen[rid] = engine.by_request[rid]
        engine.add_request = spy
        assert run(engine, reqs) == plain
        assert seen["r1"].stats.drafted == 0 and seen["r1"].stats.verify_steps > 5, kind
        assert seen["r0"].stats.drafted > 0 and seen["r2"].stats.drafted > 0, kind


def test_a_stall_in_one_timed_step_does_not_move_the_step_costs(demo, monkeypatch):
    """Each (batch, k) keeps the median of its steps' wall times: a clock on which every step takes 1 ms but one in
    nine stalls for a second gives 1 ms everywhere (a mean would give 0.11 s); k = 0 beside the drafter is priced
    at least as a plain step (here the plain steps are the slow ones)."""
    from verifier_service import warm_up

    class Clock:
        now, calls = 0.0, 0

        def perf_counter(self):
            self.calls += 1
            self.now += 1.0 if self.calls % 9 == 0 else 1e-3
            return self.now
    monkeypatch.setattr(warm_up, "time", Clock())
    engine = make_engine(demo, make_drafter("mtp", demo, K), k=K, max_running=2, budget=16)
    table = measure_step_costs(engine)
    assert np.allclose(table.seconds, 1e-3) and np.allclose(table.plain, 1e-3)
    timed = warm_up._timed_steps
    monkeypatch.setattr(warm_up, "_timed_steps", lambda engine, b, k, n, speculation: (
        (5e-3, 0.0) if not speculation else (timed(engine, b, k, n, speculation)[0], float(k))))
    table = measure_step_costs(engine)
    assert np.allclose(table.seconds[:, 0], 5e-3) and np.allclose(table.seconds[:, 1:], 1e-3)


def test_step_costs_are_measured_through_the_engine_and_the_counters_start_afresh(demo):
    engine = make_engine(demo, make_drafter("mtp", demo, K), k=K, max_running=2, budget=16)
    engine.policy.adaptive = True
    table = measure_step_costs(engine)
    assert table is engine.policy.costs and table.batch_sizes == (1, 2)
    assert table.seconds.shape == (2, K + 1) and (table.seconds > 0).all()
    assert table.drafts[:, 0].max() == 0 and (table.drafts[:, K] > 0).all()   # what each column really verified
    assert engine.stats.verify_steps == 0 and engine.step_count == 0 and sum(engine.policy.chosen) == 0
    assert not engine.has_work and not engine.by_request
    prompts = random_prompts([5, 9], demo.config.vocab_size, seed=1)
    plain = run(make_engine(demo, overlap=False, max_running=2, budget=16), requests(prompts))
    assert run(engine, requests(prompts)) == plain
    assert sum(engine.policy.chosen) > 0          # the adaptive rule chose each decoding step's k


def test_without_a_drafter_nothing_is_measured(demo):
    engine = make_engine(demo, None, k=0)
    assert measure_step_costs(engine) is None and engine.policy.costs is None


@pytest.mark.gpu
def test_gpu_any_k_per_step_gives_the_plain_output_with_graphs(tmp_path, cuda):
    """CUDA graphs, the MTP drafter on overlapped steps: steps given k = 0 (the drafter only catches up, from its catch-up graphs)
    between steps of 1..3 drafts (graph replays) still equal plain decoding (fp32); and the start-up measurement
    runs through the graphs."""
    import torch

    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), dtype=torch.float32, device=cuda)
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1], loaded.config.vocab_size, seed=6)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)}
    expected = run(make_engine(loaded, overlap=False, max_running=8), reqs)
    engine = make_engine(loaded, make_drafter("mtp", loaded, K), K, max_running=8)
    engine.policy.adaptive = True
    assert measure_step_costs(engine) is not None
    cycle = itertools.cycle([0, 3, 0, 0, 2, 1, 3])
    engine.policy.choose = lambda *args, **kwargs: DraftChoice(next(cycle))
    assert run(engine, reqs) == expected
    assert engine.overlapped_draft_steps > 0 and 0 < engine.stats.drafted < K * engine.stats.verify_steps


def test_a_host_token_drafter_is_skipped_at_k_zero_and_sent_what_it_missed(demo):
    """k = 0 with a drafter of host tokens: the engine overlaps the steps and does not ask it; when drafts resume
    the drafter is sent every token it missed, so a drafter that replays the plain continuation is accepted whole
    (it would miss after a gap otherwise)."""
    from engine_factory import synchronous_launches
    prompts = random_prompts([6, 11, 8], demo.config.vocab_size, seed=7)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)}
    plain = run(make_engine(demo, overlap=False), reqs)
    references = [p + plain[f"r{i}"][0] for i, p in enumerate(prompts)]
    engine = make_engine(demo, make_drafter("all-accept", demo, K, references), k=K)
    synchronous = synchronous_launches(engine)
    schedule = itertools.chain([3, 3], itertools.repeat(0, 8), itertools.repeat(3))
    engine.policy.choose = lambda *args, **kwargs: DraftChoice(next(schedule))
    assert run(engine, reqs) == plain
    assert engine.stats.drafted > 0 and engine.stats.accepted == engine.stats.drafted
    assert len(synchronous) < engine.step_count - 5     # the k = 0 stretch ran overlapped


def test_a_drafter_away_after_a_step_of_k_zero_still_counts_its_fallback_steps(demo):
    """A host-token drafter skipped at k = 0 that then goes away (its k is 0): steps are counted as decoded without
    the drafter (the metric an operator watches), not silently overlapped as if the policy had chosen 0."""
    drafter = make_drafter("ngram", demo, K)
    engine = make_engine(demo, drafter, k=K)
    engine.policy.choose = lambda *args, **kwargs: DraftChoice(0)
    engine.add_request("a", random_prompts([9], demo.config.vocab_size, seed=2)[0],
                       SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.fallback_steps == 0
    drafter.max_drafts = 0                                          # away: the stage's k is 0
    for _ in range(6):
        engine.step()
    assert engine.fallback_steps > 0
