"""The verifier's start-up warm-up: it reaches the step shapes a server meets (verify steps at every batch bucket,
mixed with prefill chunks of several sizes) and leaves the engine as it found it."""
import pytest
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.models import gated_deltanet
from specdec.models.cuda_graph_runner import buckets_for
from specdec.sampling_params import SamplingParams
from verifier_service.block_manager import PrefixCaching
from verifier_service.warm_up import MIN_CONTEXT, PREFILL_SIZES, warm_up


@pytest.mark.parametrize("prefix", [None, PrefixCaching(checkpoint_interval=16, num_checkpoints=16)])
def test_warm_up_mixes_prefill_chunks_with_verify_steps_at_every_bucket(tiny_model, prefix):
    """(With prefix caching too: its made-up prompts share prefixes, which would cut or skip its chunks.)"""
    engine = make_engine(tiny_model, make_drafter("ngram", tiny_model, 3), 3, max_running=8, chunk=64, budget=128,
                         prefix=prefix)
    shapes, forward = set(), engine.executor.forward

    def spy(seqs, chunks, num_drafts=None, logits="last", before=None, checkpoints=None, **kwargs):
        drafts = num_drafts or [0] * len(chunks)
        prefills = [len(c) for c, k in zip(chunks, drafts) if k == 0 and len(c) > 1]
        verifying = sum(1 for k in drafts if k == 3)
        plain = sum(1 for c, k in zip(chunks, drafts) if k == 0 and len(c) == 1)
        shapes.add((verifying, plain, max(prefills, default=0), len(prefills)))
        return forward(seqs, chunks, num_drafts, logits, before, checkpoints, **kwargs)
    engine.executor.forward = spy
    warm_up(engine, mixed=True)
    assert engine.drafter is not None and engine.drafter.kind == "ngram"
    for bucket in buckets_for(8):
        decoders = min(bucket - 1, 7)
        for size in PREFILL_SIZES[:2]:   # 16 and 64: the sizes within this engine's prefill chunk
            assert (decoders, 0, size, 1) in shapes, (bucket, size, sorted(shapes))   # decoders verify 3 drafts
            assert (0, decoders, size, 1) in shapes, (bucket, size, sorted(shapes))   # as while the drafter is away
        if decoders < 7:  # room for more than one prompt beside the decoders: a burst of them in one step
            assert any(v == decoders and n > 1 for v, _, _, n in shapes), (bucket, sorted(shapes))


def test_warm_up_leaves_nothing_behind(tiny_model):
    drafter = make_drafter("ngram", tiny_model, 3)
    engine = make_engine(tiny_model, drafter, 3, max_running=4, num_blocks=128)
    prompts = random_prompts([9, 5, 12], tiny_model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    cold = make_engine(tiny_model, make_drafter("ngram", tiny_model, 3), 3, max_running=4).generate(prompts, params)
    warm_up(engine, mixed=True)
    assert engine.drafter is drafter and not engine.has_work and not engine.by_request
    assert engine.executor.blocks.kv_blocks.num_free == 128 and engine.executor.blocks.gdn_slots.num_free == 4
    assert engine.step_count == 0 and engine.stats.verify_steps == 0 and engine.fallback_steps == 0
    assert engine.generate(prompts, params) == cold  # no state of the warm-up leaks into real requests


@pytest.mark.parametrize("k", [0, 3])
def test_without_a_drafter_the_warm_up_drafts_nothing(tiny_model, k):
    """k configured but no drafter (a verifier started without --drafter-address): serving never drafts, so
    neither does the warm-up."""
    engine = make_engine(tiny_model, None, k, max_running=2)
    seen, forward = [], engine.executor.forward
    engine.executor.forward = lambda seqs, chunks, num_drafts=None, **kwargs: (
        seen.extend(num_drafts or [0] * len(chunks)), forward(seqs, chunks, num_drafts, **kwargs))[1]
    warm_up(engine, mixed=True)
    assert seen and set(seen) == {0}
    assert engine.drafter is None and not engine.has_work and engine.executor.blocks.gdn_slots.num_free == 2


def test_a_short_maximum_context_skips_the_warm_up_with_a_warning(tiny_model, caplog):
    engine = make_engine(tiny_model, make_drafter("ngram", tiny_model, 3), 3, max_running=2)
    engine.requests.max_len = 20   # a decoder of the mixed steps (3 + 32 tokens) would not fit: refused, not a failed start
    assert engine.max_len < MIN_CONTEXT
    calls, forward = [], engine.executor.forward
    engine.executor.forward = lambda *args, **kwargs: (calls.append(1), forward(*args, **kwargs))[1]
    warm_up(engine, mixed=True)
    assert "warm-up skipped" in caplog.text and not calls and not engine.has_work


CHUNKED = gated_deltanet.CHUNKED_PREFILL_MIN_TOKENS


@pytest.mark.parametrize("chunk,budget,gpu_parts,runs", [
    (CHUNKED, CHUNKED, True, True),        # serving can reach the chunked GDN path: warmed up, one sequence
    (CHUNKED, 2048, True, True),           # a GPU's default budget: also several sequences in one step
    (64, 128, True, False),                # the default-like chunk never reaches it
    (CHUNKED, CHUNKED - 1, True, False),   # nor does a token budget below it, whatever the chunk
    (CHUNKED, CHUNKED, False, False)],     # on a CPU (the default there) nothing compiles: no long prompt
    ids=["reaches", "reaches-several", "small-chunk", "small-budget", "cpu-default"])
def test_the_chunked_gdn_prefill_is_warmed_up_when_serving_can_reach_it(tiny_model, monkeypatch, chunk, budget,
                                                                         gpu_parts, runs):
    """With a prefill chunk and a token budget of CHUNKED_PREFILL_MIN_TOKENS or more, serving meets the chunked GDN
    prefill (fla-core's kernels and the replay-only pass: seconds to compile on first use), so the warm-up runs one
    step on it; otherwise it would only spend time."""
    engine = make_engine(tiny_model, make_drafter("ngram", tiny_model, 3), 3, max_running=2, num_blocks=512,
                         chunk=chunk, budget=budget)
    chunked, several, prefill = [], [], gated_deltanet.gated_delta_rule_prefill
    monkeypatch.setattr(gated_deltanet, "gated_delta_rule_prefill",
                        lambda *args, **kwargs: (chunked.append(args[0].shape[0]),
                                                 several.append(not kwargs.get("one_sequence")),
                                                 prefill(*args, **kwargs))[2])
    prompts, add = [], engine.add_request
    engine.add_request = lambda rid, ids, params: (prompts.append(len(ids)), add(rid, ids, params))[1]
    warm_up(engine, mixed=gpu_parts)
    if runs:
        assert chunked and max(chunked) >= CHUNKED, chunked
        # the call over several sequences (host offsets, eager only) runs where the budget holds two prompts
        assert any(several) == (budget > CHUNKED), (chunked, several)
    else:
        assert not chunked and max(prompts) < CHUNKED, (chunked, sorted(prompts))
    assert not engine.has_work and engine.executor.blocks.kv_blocks.num_free == 512
