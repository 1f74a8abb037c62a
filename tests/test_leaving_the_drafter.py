"""Sequences out of the drafter (issue 41): a request with `speculation: false` and a sequence the adaptive policy
gives up on cost the drafter nothing: it never sees their rows, a step with none of them in it leaves the drafter
alone, and outputs stay those of plain decoding. The policy gives up on a sequence when, by its acceptance, plain
decoding beats every k at the step's batch size (draft_policy.py)."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from engine_factory import make_drafter, make_engine, random_prompts, synchronous_launches
from test_leaving_rules import table
from test_overlapped_steps import run

from specdec.sampling_params import SamplingParams
from verifier_service.draft_policy import EARLY_REJECTIONS, MIN_OBSERVATIONS, DraftChoice, StepCosts
from verifier_service.executor import Executor
from verifier_service.forced_acceptance import ForcedAcceptance
from verifier_service.scheduler import Scheduler, SchedulerConfig
from verifier_service.sequence import Sequence
from verifier_service.metrics import VerifierMetrics

pytestmark = pytest.mark.timeout(300)
K = 3


@pytest.fixture(scope="module")
def demo():
    from specdec.demo import demo_model_dir
    from specdec.models.loader import load_model
    return load_model(demo_model_dir())


class DrafterSpy:
    """Records, per call, the sequence ids a drafter is sent (host batches and device steps) and the ids it is
    told to release."""

    def __init__(self, engine):
        self.engine, self.calls, self.released = engine, [], []
        drafter = engine.drafter
        for name, ids in (("propose", lambda b: [s.seq_id for s in b.seqs]),
                          ("draft_on_device", lambda step: list(step.seq_ids))):
            if hasattr(drafter, name):
                setattr(drafter, name, self._wrap(getattr(drafter, name), ids))
        release = drafter.release
        drafter.release = lambda seq_ids: (self.released.extend(seq_ids), release(seq_ids))[1]

    def _wrap(self, call, ids):
        def spy(arg):
            self.calls.append((self.engine.step_count, ids(arg)))
            return call(arg)
        return spy

    def steps_with(self, seq_id: int) -> list[int]:
        return [step for step, ids in self.calls if seq_id in ids]


def with_ids(engine):
    """Wrap add_request so that each request's Sequence is kept (it leaves by_request when it ends)."""
    seqs, add = {}, engine.add_request

    def spy(rid, prompt_ids, params):
        add(rid, prompt_ids, params)
        seqs[rid] = engine.by_request[rid]
    engine.add_request = spy
    return seqs


def test_the_engine_tells_the_policy_when_prompts_wait(demo):
    """prompts_waiting (a probe then waits: test_leaving_rules.py) is true exactly while more prompt tokens are left
    to prefill than the step's token budget: the running prompts' rest and the prompts of waiting sequences that
    could be admitted (the decoders' own tokens not counted). A rest the budget holds is no wait."""
    budget = 16
    engine = make_engine(demo, make_drafter("ngram", demo, K), k=K, budget=budget, chunk=8, max_running=2)
    engine.policy.adaptive, engine.policy.costs = True, table(0.8)
    seen, choose = [], engine.policy.choose

    def spy(*args, **kwargs):
        sched = engine.scheduler
        room = sched.config.max_running - len(sched.running)
        left = (sum(max(0, s.num_prompt - s.num_cached) for s in sched.running)   # (nothing here is preempted)
                + sum(s.num_prompt for s in list(sched.waiting)[:room]))
        prefilling = any(not s.is_decoding for s in sched.running)
        seen.append((kwargs["prompts_waiting"], left > budget, prefilling, bool(sched.waiting)))
        return choose(*args, **kwargs)
    engine.policy.choose = spy
    prompts = random_prompts([5, 30, 40], demo.config.vocab_size, seed=4)   # the long ones prefill over steps
    engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert seen and all(told == truth for told, truth, _, _ in seen)
    assert any(told for told, *_ in seen) and not all(told for told, *_ in seen)
    # the rest of a prompt that the budget holds does not hold the probes back
    assert any(prefilling and not told for told, _, prefilling, _ in seen)
    # nor does a request that waits for a free place (2 running)
    assert any(queued and not told for told, _, _, queued in seen)


def test_the_tokens_left_to_prefill_count_a_preempted_sequences_output():
    """A preempted sequence recomputes its prompt and output: all of them count while it waits, and their rest once
    it runs again; a sequence that waits beyond the free places does not count."""
    sched = Scheduler(SimpleNamespace(stats=None), SchedulerConfig(max_running=2, max_batched_tokens=16))
    preempted = Sequence(0, list(range(1, 16)), num_prompt=10)    # 10 prompt tokens + 5 of output, caches released
    running = Sequence(1, list(range(1, 11)), num_prompt=10, num_cached=4)
    sched.add(preempted)
    sched.add(Sequence(2, list(range(1, 31)), num_prompt=30))     # no free place for it
    sched.running.append(running)
    assert sched.prompt_tokens_left == 15 + 6
    preempted.num_cached = 12                                     # readmitted, past its prompt: 3 tokens to go
    sched.waiting.popleft()
    sched.running.append(preempted)
    assert sched.prompt_tokens_left == 3 + 6


def test_a_burst_whose_last_prompts_fit_one_step_keeps_its_decoders_drafting(demo):
    """16 prompts arriving at once prefill in two steps; in the second the first 8 decode beside the last 8 prompts,
    whose tokens the budget holds: the young do not wait there, and no step of the burst verifies none (before,
    they waited, and the drafter they skipped cost them two more steps of drafts: 3 more steps for the batch than
    the fixed policy's, 3.7% of an H100's c16 run)."""
    prompts = random_prompts([8] * 16, demo.config.vocab_size, seed=5)
    forced = ForcedAcceptance(3.44, K, enabled=True)     # per-token acceptance 0.9
    engine = make_engine(demo, make_drafter("all-accept", demo, K, references=[]), k=K, budget=64, chunk=8,
                         max_running=16, forced=forced)
    engine.policy.adaptive, engine.policy.costs = True, table(0.8)
    verified, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda k: (verified.append(k), schedule(k))[1]
    engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert 0 not in verified, verified


@pytest.mark.parametrize("graphs", [False, True])
def test_a_step_that_pads_its_batch_is_priced_whole(demo, monkeypatch, graphs):
    """An MTP drafter drafts on the device: a step of d of its B sequences in the drafter costs in proportion to d
    when steps run eagerly, and T(B, k) whatever d is when they replay CUDA graphs (a verify bucket pads every
    sequence to k + 1 tokens): the engine tells the policy which."""
    monkeypatch.setattr(Executor, "pads_batches", property(lambda self: graphs))
    engine = make_engine(demo, make_drafter("mtp", demo, K), k=K)
    engine.policy.adaptive, engine.policy.costs = True, table(0.8)
    told, choose = [], engine.policy.choose

    def spy(*args, **kwargs):
        told.append(kwargs["proportional"])
        return choose(*args, **kwargs)
    engine.policy.choose = spy
    engine.generate(random_prompts([5, 9], demo.config.vocab_size, seed=6), SamplingParams(max_tokens=6))
    assert told and set(told) == {not graphs}


@pytest.mark.parametrize("kind", ["mtp", "ngram"])    # drafts on the device (overlapped) and on the host
def test_a_request_without_speculation_is_never_sent_to_the_drafter(demo, kind):
    prompts = random_prompts([6, 11, 8], demo.config.vocab_size, seed=5)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=12 + 20 * (i == 1), ignore_eos=True, speculation=i != 1))
            for i, p in enumerate(prompts)}
    plain = run(make_engine(demo, overlap=False), reqs)
    engine = make_engine(demo, make_drafter(kind, demo, K), k=K)
    spy, seqs = DrafterSpy(engine), with_ids(engine)
    assert run(engine, reqs) == plain
    assert spy.steps_with(seqs["r1"].seq_id) == [] and spy.steps_with(seqs["r0"].seq_id)
    assert seqs["r1"].seq_id not in spy.released and seqs["r0"].seq_id in spy.released   # nothing to free of r1
    assert seqs["r1"].stats.drafted == 0 and seqs["r0"].stats.drafted > 0
    # r1 decodes alone for its last 20 tokens: the drafter is left alone for those steps
    assert max(step for step, _ in spy.calls) < engine.step_count - 10


def test_with_nobody_in_the_drafter_a_fixed_k_engine_overlaps_its_steps(demo):
    """Only `speculation: false` requests on a fixed-k engine with a drafter of host tokens: steps verify nothing
    and overlap as plain decoding does (they were synchronous, the drafter asked for k every step)."""
    prompts = random_prompts([6, 11], demo.config.vocab_size, seed=2)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=24, ignore_eos=True, speculation=False))
            for i, p in enumerate(prompts)}
    plain = run(make_engine(demo, overlap=False), reqs)
    engine = make_engine(demo, make_drafter("ngram", demo, K), k=K)
    spy, synchronous = DrafterSpy(engine), synchronous_launches(engine)
    assert run(engine, reqs) == plain
    assert spy.calls == [] and len(synchronous) <= 2
    assert sum(engine.policy.chosen) == 0      # no step was the policy's to decide (the metric counts none)


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_sequence_given_up_on_leaves_the_drafter_for_good(demo, kind, temperature):
    """The policy gives up on one sequence after 4 steps and on another after 9 (scripted): both are released by
    the drafter, never sent to it again, verify at most the drafts of the step already in flight, and every output
    equals plain decoding; the others keep drafting."""
    prompts = random_prompts([5, 9, 14, 7], demo.config.vocab_size, seed=3)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=30, temperature=temperature, top_p=0.9, seed=i,
                                        ignore_eos=True)) for i, p in enumerate(prompts)}
    plain = run(make_engine(demo, overlap=False), reqs)
    engine = make_engine(demo, make_drafter(kind, demo, K), k=K)
    spy, seqs = DrafterSpy(engine), with_ids(engine)
    left: dict[int, tuple[int, int]] = {}     # seq id -> (step count, drafted) when it left
    calls = itertools.count()

    def scripted(seq_stats, engine_stats, opted_out=0, proportional=True, prompts_waiting=False):
        n = next(calls)
        leaving = (0,) if n in (4, 9) and seq_stats else ()
        for i in leaving:
            seq = next(s for s in seqs.values() if s.stats is seq_stats[i])
            left[seq.seq_id] = (engine.step_count, seq.stats.drafted)
        return DraftChoice(K, leaving)
    engine.policy.choose = scripted
    assert run(engine, reqs) == plain
    assert len(left) == 2 and set(left) <= set(spy.released)
    for seq_id, (step, drafted) in left.items():
        assert all(s <= step for s in spy.steps_with(seq_id))
        seq = next(s for s in seqs.values() if s.seq_id == seq_id)
        assert not seq.in_drafter and seq.stats.drafted <= drafted + K
    staying = [s for s in seqs.values() if s.seq_id not in left]
    assert all(s.in_drafter and s.stats.drafted > 0 for s in staying)


def test_the_adaptive_policy_gives_up_on_a_drafter_that_never_hits(demo):
    """A drafter whose drafts are always rejected, and step costs where plain decoding is cheaper than any
    drafting step: every sequence leaves before MIN_OBSERVATIONS rejections (one per step), as soon as the
observations it lacks could not save it on the engine's rate of nothing accepted, and not before EARLY_REJECTIONS
of its own; the steps after run
    overlapped like plain decoding, the outputs are plain decoding's, and the verifier's metrics count them."""
    prompts = random_prompts([6, 11, 8], demo.config.vocab_size, seed=7)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)}
    plain = run(make_engine(demo, overlap=False), reqs)
    references = [p + plain[f"r{i}"][0] for i, p in enumerate(prompts)]
    engine = make_engine(demo, make_drafter("all-reject", demo, K, references), k=K)
    engine.policy.adaptive = True
    engine.policy.costs = StepCosts((1, 4), np.array([[1.0, 1.1, 1.2, 1.3], [1.2, 1.4, 1.6, 1.8]]),
                                    plain=np.array([0.9, 1.0]))
    synchronous, seqs = synchronous_launches(engine), with_ids(engine)
    metrics = VerifierMetrics()
    metrics.observe(engine, [], 0.0)
    assert run(engine, reqs) == plain
    assert engine.policy.num_left == 3 and not any(s.in_drafter for s in seqs.values())
    metrics.observe(engine, [], 0.0)
    assert metrics.registry.get_sample_value("specdec_sequences_left_drafter_total") == 3
    assert all(EARLY_REJECTIONS <= s.stats.rejected_steps < MIN_OBSERVATIONS for s in seqs.values())
    assert len(synchronous) < engine.step_count - 10      # after they left, the steps overlap


@pytest.mark.gpu
def test_gpu_sequences_leaving_the_drafter_keep_plain_outputs_with_graphs(tmp_path, cuda):
    """CUDA graphs and the MTP drafter on overlapped steps: sequences leave the drafter at different steps (the
    drafter's step then gathers the rows of the others) and one never joins; outputs equal plain decoding (fp32)."""
    import torch

    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), dtype=torch.float32, device=cuda)
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1], loaded.config.vocab_size, seed=6)
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, speculation=i != 5))
            for i, p in enumerate(prompts)}
    expected = run(make_engine(loaded, overlap=False, max_running=8), reqs)
    engine = make_engine(loaded, make_drafter("mtp", loaded, K), K, max_running=8)
    calls = itertools.count()
    engine.policy.choose = lambda seq_stats, *args, **kwargs: DraftChoice(
        K, (0,) if next(calls) % 5 == 4 and seq_stats else ())
    assert run(engine, reqs) == expected
    assert engine.overlapped_draft_steps > 0


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_a_prefix_cached_by_a_request_out_of_the_drafter_serves_a_speculating_one_without_a_recompute(demo, kind):
    """A `speculation: false` request prefills a prompt and leaves checkpoints the drafter never saw. A speculating
    request with the same prompt must not resume there when the drafter keeps its own part of checkpoints (the MTP
    head: it would lack that context, a recompute from position 0): it computes the prefix once more, inside the
    drafter, and the next one resumes from it. A drafter of tokens is sent the tokens whole: it resumes at once."""
    from engine_factory import BLOCK

    from verifier_service.block_manager import PrefixCaching
    prompt = random_prompts([70], demo.config.vocab_size, seed=9)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = make_engine(demo, overlap=False).generate([prompt], params)[0]
    engine = make_engine(demo, make_drafter(kind, demo, K), k=K, chunk=16,
                         prefix=PrefixCaching(checkpoint_interval=4 * BLOCK, num_checkpoints=16))
    out_of_drafter = SamplingParams(max_tokens=8, ignore_eos=True, speculation=False)
    assert engine.generate([prompt], out_of_drafter)[0] == expected
    cached, admissions = [], []
    for _ in range(2):
        queried = engine.scheduler.prefix_stats.queried_tokens
        engine.add_request(f"again-{len(cached)}", prompt, params)
        tokens = []
        while engine.has_work:
            for o in engine.step():
                tokens += o.new_token_ids
                last = o.cached_tokens
        assert tokens == expected
        cached.append(last)
        admissions.append((engine.scheduler.prefix_stats.queried_tokens - queried) // len(prompt))
    assert admissions == [1, 1]                      # (a recompute for the drafter is a second admission)
    assert (cached[0] == 0) == (kind == "mtp") and cached[1] > 0
