"""The verifier's start-up warm-up: it reaches the step shapes a server meets (verify steps at every batch bucket,
mixed with prefill chunks of several sizes) and leaves the engine as it found it."""
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.models.cuda_graph_runner import buckets_for
from specdec.sampling_params import SamplingParams
from verifier_service.warm_up import PREFILL_SIZES, warm_up


def test_warm_up_mixes_prefill_chunks_with_verify_steps_at_every_bucket(tiny_model):
    engine = make_engine(tiny_model, make_drafter("ngram", tiny_model, 3), 3, max_running=8, chunk=64, budget=128)
    shapes, forward = set(), engine.runner.forward

    def spy(seqs, chunks, num_drafts=None, logits="last"):
        drafts = num_drafts or [0] * len(chunks)
        prefills = [len(c) for c, k in zip(chunks, drafts) if k == 0 and len(c) > 1]
        shapes.add((sum(1 for k in drafts if k == 3), max(prefills, default=0), len(prefills)))
        return forward(seqs, chunks, num_drafts, logits)
    engine.runner.forward = spy
    warm_up(engine, mixed=True)
    for bucket in buckets_for(8):
        decoders = min(bucket - 1, 7)
        for size in PREFILL_SIZES[:2]:   # 16 and 64: the sizes within this engine's prefill chunk
            assert (decoders, size, 1) in shapes, (bucket, size, sorted(shapes))
        if decoders < 7:  # room for more than one prompt beside the decoders: a burst of them in one step
            assert any(v == decoders and n > 1 for v, _, n in shapes), (bucket, sorted(shapes))


def test_warm_up_leaves_nothing_behind(tiny_model):
    drafter = make_drafter("ngram", tiny_model, 3)
    engine = make_engine(tiny_model, drafter, 3, max_running=4, num_blocks=128)
    prompts = random_prompts([9, 5, 12], tiny_model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    cold = make_engine(tiny_model, make_drafter("ngram", tiny_model, 3), 3, max_running=4).generate(prompts, params)
    warm_up(engine, mixed=True)
    assert engine.drafter is drafter and not engine.has_work and not engine.by_request
    assert engine.runner.blocks.num_free == 128 and engine.runner.gdn_slots.num_free == 4
    assert engine.step_count == 0 and engine.stats.verify_steps == 0 and engine.drafter_fallback_steps == 0
    assert engine.generate(prompts, params) == cold  # no state of the warm-up leaks into real requests


def test_plain_decoding_warms_up_without_drafts(tiny_model):
    engine = make_engine(tiny_model, None, 0, max_running=2)
    warm_up(engine, mixed=True)
    assert engine.drafter is None and not engine.has_work and engine.runner.gdn_slots.num_free == 2
