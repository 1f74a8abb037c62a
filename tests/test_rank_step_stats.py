"""What profiles a tensor-parallel engine's steps: each rank r > 0's host time per step (RankStepStats: its wait for
rank 0's message, its launch of the step, logged once a window and at stop), and the synthetic drafter beside the ranks
(CPU, gloo, 2 ranks)."""
import re

import pytest

from specdec.sampling_params import SamplingParams
from verifier_service.rank_step_stats import RankStepStats

# (waiting_from, launching_from, done) of each step, in seconds
WINDOW = [(10.0, 10.1, 10.3), (10.3, 10.4, 10.6), (10.6, 10.7, 11.0), (11.0, 11.5, 11.7)]


def test_a_window_of_steps_gives_one_line_of_mean_median_and_max():
    """A window ends with the first step that ends every_s after the window's first wait began; the next one
    begins with the step after it, and stop gives the line of the steps since."""
    stats = RankStepStats(1, every_s=1.5)
    assert [stats.add(*step) for step in WINDOW[:3]] == [None] * 3
    assert stats.add(*WINDOW[3]) == ("rank 1: 4 steps in 1.7 s: waiting for rank 0's message 200.00 ms a step "
                                     "(p50 100.00), launching the step 225.00 ms a step (p50 200.00, max 300.0)")
    assert stats.add(20.0, 20.001, 20.003) is None    # a new window, from this step's wait
    assert stats.close() == ("rank 1: 1 step in 0.0 s: waiting for rank 0's message 1.00 ms a step (p50 1.00), "
                             "launching the step 2.00 ms a step (p50 2.00, max 2.0)")
    assert stats.close() is None                      # no step since


def test_a_wait_of_a_second_or_more_is_idle_time_not_a_steps_wait():
    """Start-up, or no requests: the first step's long wait does not start the window (nor end it at once), and a
    later one is counted as idle, out of the waits' mean and median."""
    stats = RankStepStats(1, every_s=60.0)
    assert stats.add(0.0, 75.0, 75.002) is None       # 75 s from ready to the first step: the window starts at 75
    assert stats.add(75.002, 75.003, 75.005) is None
    assert stats.add(75.005, 95.0, 95.002) is None    # 20 s without requests
    assert stats.close() == ("rank 1: 3 steps in 20.0 s, 20.0 s of it idle: waiting for rank 0's message 1.00 ms a "
                             "step (p50 1.00), launching the step 2.00 ms a step (p50 2.00, max 2.0)")
    stats.add(0.0, 5.0, 5.001)
    assert "waiting for rank 0's message -, launching" in stats.close()


def test_the_medians_take_a_windows_first_steps_the_mean_and_max_all():
    stats = RankStepStats(2, every_s=60.0)
    stats.NUM_KEPT = 2
    t = 0.0
    for launch_s in (0.001, 0.001, 0.5, 0.5, 0.5):   # the median of all five would be 500 ms
        assert stats.add(t, t, t + launch_s) is None
        t += launch_s
    assert stats.close().endswith("launching the step 300.40 ms a step (p50 1.00, max 500.0)")


def test_every_s_0_logs_nothing():
    stats = RankStepStats(1, every_s=0)
    assert [stats.add(*step) for step in WINDOW] == [None] * 4
    assert stats.close() is None


@pytest.mark.timeout(300)
def test_the_synthetic_drafter_runs_beside_two_ranks_and_rank_1_logs_its_steps(tiny_dir, capfd):
    """The synthetic drafter needs no weights: the builder runs it beside tensor-parallel ranks (a profile's verify
    steps of k drafts, their acceptance forced); rank 1 (a child process, its log on the inherited stderr) gives
    its line at stop."""
    from drafter_service.synthetic import SyntheticDrafter
    from verifier_service.builder import VerifierConfig, build_engine
    config = VerifierConfig(str(tiny_dir), num_drafts=3, in_process_drafter="synthetic", max_running=2,
                            max_context=128, tensor_parallel_size=2, forced_acceptance_length=3.0,
                            unsafe_forced_acceptance=True, warm_up=False)
    engine = build_engine(config, lambda loaded, config: SyntheticDrafter([], 3, loaded.config.vocab_size))
    try:
        out = engine.generate([[5, 17, 3, 99], [64, 8]], SamplingParams(max_tokens=16, ignore_eos=True))
        assert [len(tokens) for tokens in out] == [16, 16]
        assert engine.stats.drafted > 0 and engine.stats.accepted > 0
    finally:
        engine.executor.close()
    err = capfd.readouterr().err
    steps = re.search(r"rank 1: (\d+) steps in [\d.]+ s[^:]*: waiting for rank 0's message [\d.]+ ms a step "
                      r"\(p50 [\d.]+\), launching the step [\d.]+ ms a step \(p50 [\d.]+, max [\d.]+\)", err)
    assert steps and int(steps.group(1)) >= 5, err[-3000:]
