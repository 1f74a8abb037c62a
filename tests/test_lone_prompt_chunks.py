"""A long prompt's chunks run alone, in turns with the decoding sequences (issue 38: on a GPU a chunk alone replays
its prefill graph with the chunked GDN kernel). Outputs equal those of mixed steps; the decoders get a step
between any two of its chunks; a prompt with no one beside it never waits for turns."""
import pytest
from engine_factory import make_drafter, make_engine, random_prompts
from test_overlapped_steps import run

from specdec.sampling_params import SamplingParams
from verifier_service.block_manager import PrefixCaching

pytestmark = pytest.mark.timeout(300)
LONE = 16


def recorded(engine) -> list[list[tuple[str, int, bool]]]:
    """Each step's entries as (request id, chunk length, decoding), appended as the scheduler plans them."""
    steps, schedule = [], engine.scheduler.schedule

    def spy(max_drafts):
        s = schedule(max_drafts)
        steps.append([(e.seq.request_id, len(e.chunk), e.decoding) for e in s.entries])
        return s
    engine.scheduler.schedule = spy
    return steps


def requests(tiny_model, seed=5):
    """Three short prompts that decode, and one of 150 tokens added once they do."""
    prompts = random_prompts([6, 9, 4, 150], tiny_model.config.vocab_size, seed=seed)
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3 + [SamplingParams(max_tokens=8, ignore_eos=True)]
    return {f"d{i}": (p, q) for i, (p, q) in enumerate(zip(prompts[:3], params))}, ("long", prompts[3], params[3])


@pytest.mark.parametrize("drafter", [None, "ngram", "mtp"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_long_prompt_takes_turns_with_the_decoders(tiny_model, drafter, overlap):
    decoders, late = requests(tiny_model)
    outputs = []
    for lone in (0, LONE):
        k = 3 if drafter else 0
        engine = make_engine(tiny_model, make_drafter(drafter, tiny_model, k) if drafter else None, k=k, chunk=32,
                             budget=64, overlap=overlap, lone_chunk=lone)
        steps = recorded(engine)
        outputs.append(run(engine, decoders, add_later={3: late}))
        long_steps = [i for i, s in enumerate(steps) if any(r == "long" and not d and n >= LONE for r, n, d in s)]
        if lone:
            assert len(long_steps) >= 4
            assert all(len(steps[i]) == 1 for i in long_steps[1:])          # after admission: its chunks alone
            assert all(b - a >= 2 and any(r.startswith("d") for r, _, _ in steps[a + 1])
                       for a, b in zip(long_steps[1:], long_steps[2:]))       # the decoders' step between two chunks
        else:
            assert any(len(steps[i]) > 1 for i in long_steps[1:])            # mixed with the decoders
    assert outputs[0] == outputs[1]


def test_a_prompt_alone_does_not_wait_for_turns(tiny_model):
    prompt = random_prompts([150], tiny_model.config.vocab_size, seed=2)[0]
    engine = make_engine(tiny_model, chunk=32, budget=64, lone_chunk=LONE)
    steps = recorded(engine)
    run(engine, {"long": (prompt, SamplingParams(max_tokens=4, ignore_eos=True))})
    assert [n for s in steps for _, n, d in s if not d] == [30] * 5   # five equal chunks in five steps


def test_long_prompts_with_no_one_else_run_together_without_empty_turns(tiny_model):
    prompts = random_prompts([150, 120], tiny_model.config.vocab_size, seed=4)
    engine = make_engine(tiny_model, chunk=32, budget=64, lone_chunk=LONE)
    steps = recorded(engine)
    run(engine, {f"p{i}": (p, SamplingParams(max_tokens=4, ignore_eos=True)) for i, p in enumerate(prompts)})
    prefill = [i for i, s in enumerate(steps) if any(not d for _, _, d in s)]
    assert all(steps[prefill[0]:prefill[-1] + 1]), "an empty step while the prompts prefill"
    assert any(len(s) == 2 and not any(d for _, _, d in s) for s in steps)   # both prompts' chunks in one step


def test_a_prompt_beside_decoders_runs_in_equal_chunks_with_no_sliver(tiny_model):
    """Three decoders leave a prompt 61 tokens of a 64-token step. With checkpoints every 64 tokens it reaches each
    in two chunks of about 32 (not 61, then a sliver of 3 that costs the decoders a step of its own); without them it
    runs in equal chunks to its end. The outputs are the same both ways; a repeat of the prompt resumes from its
    last checkpoint (the chunk from a cache hit's start) and gives the same tokens again."""
    decoders, (_, prompt, params) = requests(tiny_model)
    prompt = (prompt * 2)[:300]
    outputs = []
    for prefix in (True, False):
        engine = make_engine(tiny_model, chunk=64, budget=64,
                             prefix=PrefixCaching(checkpoint_interval=64, num_checkpoints=16) if prefix else None)
        steps = recorded(engine)
        outputs.append(run(engine, decoders, add_later={3: ("long", prompt, params)}))
        chunks = [n for s in steps for r, n, d in s if r == "long" and not d]
        assert len(chunks) == (10 if prefix else 5), chunks            # 32 + 31, 3 x (32 + 32), 44, 1; 5 x 60
        assert max(chunks) <= 61 and min(chunks[:-1] if prefix else chunks) >= 31, chunks
        if prefix:
            again = run(engine, {"again": (prompt, params)})
            assert again["again"] == outputs[0]["long"]
            assert engine.scheduler.prefix_stats.hit_tokens >= 296
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("drafter", [None, "mtp"])
def test_a_prompt_beside_decoders_takes_the_mixed_chunk_and_alone_the_whole_one(tiny_model, drafter):
    """--mixed-prefill-chunk bounds a prompt's chunk while decoders share its steps (each of them waits for the whole
    step); once they are done it takes --prefill-chunk. Outputs are those of one chunk size throughout."""
    decoders, (_, prompt, params) = requests(tiny_model)
    decoders = {rid: (p, SamplingParams(max_tokens=10, ignore_eos=True)) for rid, (p, _) in decoders.items()}
    prompt = (prompt * 4)[:600]
    k = 3 if drafter else 0
    outputs = []
    for mixed in (0, 16):
        engine = make_engine(tiny_model, make_drafter(drafter, tiny_model, k) if drafter else None, k=k, chunk=64,
                             budget=96, mixed_chunk=mixed, num_blocks=1024)
        steps = recorded(engine)
        outputs.append(run(engine, decoders, add_later={3: ("long", prompt, params)}))
        beside = [n for s in steps for r, n, d in s if r == "long" and not d and any(dd for _, _, dd in s)]
        alone = [n for s in steps for r, n, d in s if r == "long" and not d and len(s) == 1]
        assert beside and alone, (beside, alone)
        assert (max(beside) <= 16 if mixed else min(beside) > 16) and max(alone) > 16, (beside, alone)
    assert outputs[0] == outputs[1]


def test_the_verifier_cli_passes_the_mixed_prefill_chunk(monkeypatch, tiny_dir, capsys):
    """`specdec verifier --mixed-prefill-chunk N` reaches its config (0: the device's default); a negative one is
    refused before anything loads."""
    import verifier_service.server
    from specdec_tools.cli import main
    seen = []
    monkeypatch.setattr(verifier_service.server, "serve", lambda config, *a, **kw: seen.append(config))
    assert main(["verifier", "--model", str(tiny_dir), "--device", "cpu", "--mixed-prefill-chunk", "96"]) == 0
    assert main(["verifier", "--model", str(tiny_dir), "--device", "cpu"]) == 0
    assert [c.mixed_prefill_chunk for c in seen] == [96, 0]
    assert seen[1].with_device_limits().mixed_prefill_chunk == 256
    assert main(["verifier", "--model", str(tiny_dir), "--device", "cpu", "--mixed-prefill-chunk", "-1"]) == 2
    assert "--mixed-prefill-chunk must be >= 0" in capsys.readouterr().err and len(seen) == 2


def test_two_prompts_beside_decoders_share_one_mixed_chunk(tiny_model):
    """--mixed-prefill-chunk bounds the prompt tokens of a step that decoders share, not each prompt's: two prompts
    arriving together beside three decoders take 24 tokens between them per step, in a 96-token budget."""
    decoders, (_, prompt, params) = requests(tiny_model)
    engine = make_engine(tiny_model, chunk=64, budget=96, mixed_chunk=24, num_blocks=1024)
    steps = recorded(engine)
    run(engine, decoders, add_later={3: ("a", prompt, params), 4: ("b", prompt[::-1], params)})
    beside = [sum(n for r, n, d in s if not d) for s in steps if any(d for _, _, d in s)]
    both = [s for s in steps if {"a", "b"} <= {r for r, _, d in s if not d}]
    assert both and max(beside) <= 24, beside


def test_the_checkpoint_interval_follows_a_long_prefill_chunk(monkeypatch, tiny_dir, capsys):
    """A prompt chunk ends at each prefix checkpoint, so the interval left at 0 is the larger of 1024 and the
    prefill chunk (whole blocks of 16): a GPU's 2048-token chunks are not cut to 1024. Given, it is kept; the CLI
    refuses one that is not a multiple of 16."""
    from verifier_service.builder import VerifierConfig
    assert VerifierConfig("m", device="cpu").with_device_limits().prefix_checkpoint_interval == 1024
    assert VerifierConfig("m", device="cuda").with_device_limits().prefix_checkpoint_interval == 2048
    assert VerifierConfig("m", prefill_chunk=3000).with_device_limits().prefix_checkpoint_interval == 2992
    assert VerifierConfig("m", prefill_chunk=4096, prefix_checkpoint_interval=512).with_device_limits() \
        .prefix_checkpoint_interval == 512
    import verifier_service.server
    from specdec_tools.cli import main
    seen = []
    monkeypatch.setattr(verifier_service.server, "serve", lambda config, *a, **kw: seen.append(config))
    assert main(["verifier", "--model", str(tiny_dir), "--device", "cpu", "--prefill-chunk", "4096"]) == 0
    assert seen[0].with_device_limits().prefix_checkpoint_interval == 4096
    assert main(["verifier", "--model", str(tiny_dir), "--device", "cpu", "--prefix-checkpoint-interval", "24"]) == 2
    assert "multiple of 16" in capsys.readouterr().err and len(seen) == 1
    from verifier_service.block_manager import BlockManager, PrefixCaching
    with pytest.raises(ValueError, match="positive multiple"):   # an interval left at 0 never reaches the blocks
        BlockManager(8, 16, 2, 4, PrefixCaching(checkpoint_interval=0, num_checkpoints=2))


def test_the_mtp_drafter_expects_the_verifiers_largest_default_step():
    """The drafter service cannot read the verifier's config (the services import nothing of each other): its
    catch-up graphs and warm-up are sized by a constant that must follow the verifier's GPU token budget."""
    import inspect

    from drafter_service.mtp.draft_loop import MAX_STEP_TOKENS
    from drafter_service.mtp.warm_up import warm_up
    from verifier_service.builder import DEVICE_LIMITS
    assert MAX_STEP_TOKENS == inspect.signature(warm_up).parameters["max_tokens"].default \
        == DEVICE_LIMITS["cuda"]["max_batched_tokens"]
