"""Greedy speculative decoding is lossless: token-identical to plain decoding (docs/sampling.md)."""
import pytest
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.sampling_params import SamplingParams

LENGTHS = [3, 7, 12, 20, 5, 9, 30, 1]
MAX_TOKENS = [20, 33, 17, 40, 25, 30, 12, 28]
DRAFTERS = ["mtp", "ngram", "synthetic", "all-accept", "all-reject"]


@pytest.fixture(scope="module")
def baseline(tiny_model):
    prompts = random_prompts(LENGTHS, tiny_model.config.vocab_size)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    return prompts, params, make_engine(tiny_model).generate(prompts, params)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_equals_plain_decoding(tiny_model, baseline, kind, k):
    prompts, params, expected = baseline
    references = [p + e for p, e in zip(prompts, expected)]
    drafter = make_drafter(kind, tiny_model, k, references)
    engine = make_engine(tiny_model, drafter, k)
    assert engine.generate(prompts, params) == expected
    stats = engine.stats
    assert stats.emitted == sum(MAX_TOKENS) - len(prompts)  # every token but the prefill one is from a verify
    assert stats.emitted == stats.verify_steps + stats.accepted  # one recovered or bonus token per step
    if kind == "all-accept":
        assert stats.accepted == stats.drafted > 0
    if kind == "all-reject":
        assert stats.accepted == 0 and stats.drafted > 0 and stats.mean_acceptance_length == 1.0
    assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size
    assert engine.executor.blocks.gdn_slots.num_free == engine.executor.blocks.gdn_slots.size


@pytest.mark.parametrize("kind", ["mtp", "all-accept"])
def test_lossless_under_preemption(tiny_model, baseline, kind):
    """Too few KV blocks for all 8: sequences are preempted, recomputed, and still decode identically; the
    verifier's metrics count the preemptions (once each)."""
    from verifier_service.metrics import VerifierMetrics
    prompts, params, expected = baseline
    drafter = make_drafter(kind, tiny_model, 3, [p + e for p, e in zip(prompts, expected)])
    engine = make_engine(tiny_model, drafter, 3, num_blocks=24)
    assert engine.generate(prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0
    metrics = VerifierMetrics()
    for _ in range(2):
        metrics.observe(engine, [], 0.0)
    assert metrics.registry.get_sample_value("specdec_preemptions_total") == engine.scheduler.num_preemptions


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_moe_families_with_mtp(tmp_path, family):
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, family=family, mtp_layers=2, progress=False))
    prompts = random_prompts([4, 11, 6], loaded.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = make_engine(loaded).generate(prompts, params)
    engine = make_engine(loaded, make_drafter("mtp", loaded, 3), 3)
    assert engine.generate(prompts, params) == expected
    assert engine.stats.drafted > 0


def test_stop_conditions(tiny_model, baseline):
    """EOS and stop_token_ids end a request at the first such token, even mid-way through accepted drafts."""
    prompts, params, expected = baseline
    out = expected[3]  # 39 tokens of a 40-token request
    stop_at = out[10]
    first = out.index(stop_at)
    drafter = make_drafter("all-accept", tiny_model, 4, [prompts[3] + out])
    engine = make_engine(tiny_model, drafter, 4)
    got = engine.generate([prompts[3]], SamplingParams(max_tokens=40, stop_token_ids=(stop_at,), ignore_eos=True))
    assert got == [out[:first + 1]]
    short = make_engine(tiny_model, make_drafter("all-accept", tiny_model, 4, [prompts[3] + out]), 4)
    assert short.generate([prompts[3]], SamplingParams(max_tokens=6, ignore_eos=True)) == [out[:6]]


def test_mtp_drafter_out_of_blocks_drops_sequences_not_requests(tiny_model, baseline, caplog):
    """An MTP drafter with too few KV blocks gives up some sequences; they decode without drafts, still exactly."""
    from drafter_service.mtp.mtp_drafter import MTPDrafter
    prompts, params, expected = baseline
    drafter = MTPDrafter(tiny_model, 3, num_blocks=12, block_size=4)
    engine = make_engine(tiny_model, drafter, 3)
    assert engine.generate(prompts, params) == expected
    assert engine.stats.drafted > 0
    assert drafter.tables.blocks.num_free == 12 and not drafter.dropped  # all given back when the requests ended
    assert "dropped by the mtp drafter" in caplog.text
