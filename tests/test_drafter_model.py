"""The draft-model drafter: a smaller model drafts greedily with its own KV + GDN state, rolled back to the
accepted prefix by recompute. Greedy speculative decoding with it is token-identical to plain decoding; with
the target as its own draft model every draft is accepted (a strict check of the rollback: one stale state
would make some draft differ from the target's argmax)."""
import grpc
import pytest
from engine_factory import make_drafter, make_engine, random_prompts

from drafter_service.draft_model import DraftModelDrafter
from specdec.drafting import DraftBatch, DraftInput
from specdec_tools.local_stack import LocalStack, StackConfig
from specdec.models.loader import load_model
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec_tools.tiny import make_tiny

LENGTHS = [3, 7, 12, 20, 5, 9, 30, 1]     # batch 8, ragged
MAX_TOKENS = [20, 33, 17, 40, 25, 30, 12, 28]
SMALLER = {"hidden_size": 32, "num_hidden_layers": 2, "full_attention_interval": 2, "intermediate_size": 64,
           "linear_num_value_heads": 2, "linear_num_key_heads": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def family_models(request, tmp_path_factory):
    """(target, a smaller draft model of the same family and vocabulary, plain-decoding baseline)."""
    root = tmp_path_factory.mktemp(request.param)
    target = load_model(make_tiny(root / "target", family=request.param, seed=0, progress=False))
    small = load_model(make_tiny(root / "draft", family=request.param, seed=1, overrides=SMALLER, progress=False))
    assert small.config.num_hidden_layers < target.config.num_hidden_layers
    prompts = random_prompts(LENGTHS, target.config.vocab_size)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    return target, small, prompts, params, make_engine(target).generate(prompts, params)


def _check_finished_clean(engine, drafter):
    assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size
    assert drafter.blocks.num_free == drafter.blocks.size and drafter.pairs.num_free == drafter.pairs.size
    assert not drafter.seqs


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("draft", ["the target itself", "a smaller model"])
def test_draft_model_is_lossless(family_models, draft, k):
    """Greedy output equals plain decoding; the target as its own draft model has every draft accepted."""
    target, small, prompts, params, expected = family_models
    drafter = make_drafter("draft_model", target, k, draft_model=target if draft == "the target itself" else small)
    engine = make_engine(target, drafter, k)
    assert engine.generate(prompts, params) == expected
    assert engine.stats.drafted > 0
    if draft == "the target itself":
        assert engine.stats.accepted == engine.stats.drafted
    _check_finished_clean(engine, drafter)


def test_lossless_and_all_accepted_under_preemption(family_models):
    """Too few target KV blocks for all 8: sequences are preempted, recomputed; the draft model forgets and
    rebuilds them, and still every draft is accepted."""
    target, _, prompts, params, expected = family_models
    drafter = make_drafter("draft_model", target, 3, draft_model=target)
    engine = make_engine(target, drafter, 3, num_blocks=24)
    assert engine.generate(prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.accepted == engine.stats.drafted > 0
    _check_finished_clean(engine, drafter)


def test_draft_model_out_of_slots_drops_sequences_not_requests(family_models, caplog):
    target, _, prompts, params, expected = family_models
    drafter = DraftModelDrafter(target, 3, num_blocks=256, block_size=4, max_seqs=3)
    engine = make_engine(target, drafter, 3)
    assert engine.generate(prompts, params) == expected
    assert 0 < engine.stats.drafted and "dropped by the draft model" in caplog.text
    assert drafter.pairs.num_free == 3 and not drafter.dropped


def test_rollback_is_exact_after_a_rejection(family_models):
    """Drive the drafter by hand: after drafts are rejected, its next proposal equals that of a fresh drafter
    given the committed tokens alone (the speculative state left no trace)."""
    target, _, prompts, _, _ = family_models
    prompt = prompts[3]
    used, fresh = (DraftModelDrafter(target, 4, num_blocks=64, block_size=4, max_seqs=2) for _ in range(2))
    first = used.propose(DraftBatch(1, [DraftInput(7, 0, prompt, 4)])).drafts[0]
    assert len(first) == 4
    wrong = (first[0] + 1) % target.config.vocab_size  # verifier rejected draft 1 and emitted another token
    again = used.propose(DraftBatch(2, [DraftInput(7, len(prompt) - 1, [prompt[-1], wrong], 4)])).drafts[0]
    reference = fresh.propose(DraftBatch(1, [DraftInput(7, 0, prompt + [wrong], 4)])).drafts[0]
    assert again == reference


def test_unknown_sequence_past_position_zero_is_reported_missing(family_models):
    target, _, _, _, _ = family_models
    drafter = DraftModelDrafter(target, 2, num_blocks=16, block_size=4, max_seqs=2)
    out = drafter.propose(DraftBatch(1, [DraftInput(5, 10, [1, 2], 2), DraftInput(6, 0, [3, 4, 5], 2)]))
    assert out.missing == [5] and out.drafts[0] == [] and len(out.drafts[1]) == 2


@pytest.mark.timeout(300)
def test_draft_model_served_by_the_three_processes(tiny_dir, tmp_path):
    """`--drafter draft_model --draft-model DIR` through the real services: the target as its own draft model
    is accepted at the handshake and every draft it makes is accepted."""
    prompt = [5, 17, 3, 99, 42]
    expected = make_engine(load_model(tiny_dir)).generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    stack = LocalStack(StackConfig(model=str(tiny_dir), drafter="draft_model", num_drafts=3, port=0,
                                   drafter_args=("--draft-model", str(tiny_dir)), log_dir=str(tmp_path),
                                   startup_timeout_s=120))
    stack.start()
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            assert stub.Info(gateway_pb2.InfoRequest(), timeout=10).drafter_kind == "draft_model"
            sampling = gateway_pb2.SamplingParams(max_tokens=24, ignore_eos=True)
            replies = list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling),
                                         timeout=120))
        assert [t for r in replies for t in r.token_ids] == expected[0]
        usage = replies[-1].usage
        assert usage.draft_tokens > 0 and usage.accepted_tokens == usage.draft_tokens
    finally:
        stack.stop()
