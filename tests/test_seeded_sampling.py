"""Seeded sampling at temperature > 0 is token-identical with and without speculation (docs/sampling.md):
for any k, any one-hot drafter, batch mates, preemption, draft truncation by the token budget and drafter
fallback; penalties and logprobs are exact under speculation."""
import pytest
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.drafting import DraftOutput
from specdec.sampling_params import SamplingParams

LENGTHS = [3, 7, 12, 5, 9, 1, 14, 6]
MAX_TOKENS = 24
PARAMS = {
    "t0.8-top-p0.9": dict(temperature=0.8, top_p=0.9),
    "penalties": dict(temperature=0.8, top_k=60, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.5,
                      frequency_penalty=0.4),
}


def params_for(name: str, n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS, seed=1000 + i, ignore_eos=True, **PARAMS[name]) for i in range(n)]


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Plain seeded decoding (k = 0) of 8 prompts, per parameter set."""
    prompts = random_prompts(LENGTHS, tiny_model.config.vocab_size, seed=11)
    return prompts, {name: make_engine(tiny_model).generate(prompts, params_for(name, len(prompts)))
                     for name in PARAMS}


class FlakyDrafter:
    """Wraps a drafter; every third step it answers nothing (as a failed remote drafter does: k = 0)."""

    def __init__(self, inner):
        self.inner, self.kind, self.needs_hidden, self.max_drafts = inner, inner.kind, inner.needs_hidden, inner.max_drafts
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        out = self.inner.propose(batch)
        return DraftOutput(drafts=[[] for _ in out.drafts]) if self.calls % 3 == 0 else out

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def clear(self):
        self.inner.clear()


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["mtp", "ngram", "synthetic", "all-accept"])
def test_seeded_spec_equals_plain_batch_8(tiny_model, plain, kind, k, name):
    prompts, expected = plain
    references = [p + e for p, e in zip(prompts, expected[name])]
    engine = make_engine(tiny_model, make_drafter(kind, tiny_model, k, references), k)
    assert engine.generate(prompts, params_for(name, len(prompts))) == expected[name]
    if kind == "all-accept":  # the drafter proposes plain decoding's tokens: the coupled draw accepts them all
        assert engine.stats.accepted == engine.stats.drafted > 0


@pytest.mark.parametrize("kind", ["mtp", "synthetic"])
def test_seeded_spec_equals_plain_alone(tiny_model, plain, kind):
    prompts, expected = plain
    references = [p + e for p, e in zip(prompts, expected["penalties"])]
    engine = make_engine(tiny_model, make_drafter(kind, tiny_model, 3, references), 3)
    assert engine.generate(prompts[6:7], params_for("penalties", 8)[6:7]) == expected["penalties"][6:7]


@pytest.mark.parametrize("name", list(PARAMS))
def test_seeded_under_preemption_truncation_and_fallback(tiny_model, plain, name):
    """Few KV blocks (preemption by recompute), a token budget that truncates drafts, a drafter that fails
    every third step: still the tokens of plain decoding."""
    prompts, expected = plain
    references = [p + e for p, e in zip(prompts, expected[name])]
    drafter = FlakyDrafter(make_drafter("synthetic", tiny_model, 4, references))
    engine = make_engine(tiny_model, drafter, 4, num_blocks=26, budget=14)
    assert engine.generate(prompts, params_for(name, len(prompts))) == expected[name]
    assert engine.scheduler.num_preemptions > 0 and engine.stats.accepted > 0


def test_greedy_with_penalties_spec_equals_plain(tiny_model, plain):
    prompts, _ = plain
    params = [SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=1.5, frequency_penalty=1.0,
                             presence_penalty=0.7, ignore_eos=True)] * len(prompts)
    expected = make_engine(tiny_model).generate(prompts, params)
    unpenalised = make_engine(tiny_model).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert expected != unpenalised  # the penalties change greedy output on this model
    references = [p + e for p, e in zip(prompts, expected)]
    for kind in ("mtp", "all-accept"):
        engine = make_engine(tiny_model, make_drafter(kind, tiny_model, 3, references), 3)
        assert engine.generate(prompts, params) == expected


def _run_with_logprobs(engine, prompts, params):
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params):
        engine.add_request(rid, prompt, sp)
    tokens, logprobs = {r: [] for r in ids}, {r: [] for r in ids}
    while engine.has_work:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += o.logprobs
    return [tokens[r] for r in ids], [logprobs[r] for r in ids]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_spec_equal_plain(tiny_model, plain, temperature):
    prompts, _ = plain
    params = [SamplingParams(max_tokens=16, temperature=temperature, top_k=40, seed=7 + i, logprobs=5,
                             repetition_penalty=1.2, ignore_eos=True) for i in range(len(prompts))]
    want_tokens, want = _run_with_logprobs(make_engine(tiny_model), prompts, params)
    references = [p + t for p, t in zip(prompts, want_tokens)]
    engine = make_engine(tiny_model, make_drafter("all-accept", tiny_model, 3, references), 3)
    got_tokens, got = _run_with_logprobs(engine, prompts, params)
    assert got_tokens == want_tokens and engine.stats.accepted > 0
    # The sampler is exact; the forward is not bitwise shape-independent: in fp32 a 4-token verify forward and
    # a 1-token decode forward of this random model differ by up to 1e-4 in logits of magnitude ~30, which
    # moves logprobs by up to ~1.3e-5. Hence 3e-5.
    for seq_want, seq_got, toks in zip(want, got, want_tokens):
        assert [lp.token_id for lp in seq_got] == toks
        for a, b in zip(seq_want, seq_got):
            assert abs(a.logprob - b.logprob) < 3e-5
            assert a.top_token_ids == b.top_token_ids and len(b.top_token_ids) == 5
            assert all(abs(x - y) < 3e-5 * max(1.0, abs(x)) for x, y in zip(a.top_logprobs, b.top_logprobs)), \
                (a.top_logprobs, b.top_logprobs)
            assert b.logprob <= b.top_logprobs[0] + 1e-6 and b.logprob > float("-inf")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PARAMS))
def test_gpu_seeded_spec_equals_plain_through_the_triton_sampler(tmp_path, cuda, name, monkeypatch):
    """On CUDA every verdict goes through the one-launch Triton sampler; seeded spec output (MTP k = 3 and a
    drafter whose drafts are all accepted) is still token-identical to seeded plain decoding on the same device."""
    import kernels.sampling.speculative as dispatch
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    calls = []
    kernel = dispatch.speculative_sample_triton
    monkeypatch.setattr(dispatch, "speculative_sample_triton", lambda *a: calls.append(1) or kernel(*a))
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), device=cuda)
    prompts = random_prompts(LENGTHS, loaded.config.vocab_size, seed=11)
    expected = make_engine(loaded).generate(prompts, params_for(name, len(prompts)))
    assert calls, "plain decoding did not use the Triton sampler"
    references = [p + e for p, e in zip(prompts, expected)]
    for kind in ("mtp", "all-accept"):
        engine = make_engine(loaded, make_drafter(kind, loaded, 3, references), 3)
        assert engine.generate(prompts, params_for(name, len(prompts))) == expected, kind
    assert engine.stats.accepted == engine.stats.drafted > 0   # all-accept: the kernel took every draft
