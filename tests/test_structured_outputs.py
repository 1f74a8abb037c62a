"""Grammar-constrained decoding in the verifier (issue 40): outputs follow the grammar, exactly as plain constrained
decoding does with and without drafts (greedy and seeded), a draft the grammar refuses is never accepted, the
matcher ends where the committed output is, and bad grammars are refused by name."""
import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from specdec.demo import demo_model_dir
from specdec.grammar import GrammarError, Grammars, RowMasks, masks_array, unpack_mask
from specdec.rpc.sampling_codec import params_from_proto, params_to_proto
from specdec.sampling_params import GrammarSpec, SamplingError, SamplingParams
from specdec_tools.commands.in_process_drafter import in_process_drafter
from verifier_service.builder import VerifierConfig, build_engine
from verifier_service.sampler import VerifyRows, sample

pytestmark = pytest.mark.timeout(600)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "count": {"type": "integer"},
                         "kind": {"enum": ["a", "b", "c"]}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
PROMPTS = ["# user: describe the config\n\n", "def parse(x):\n    return ", "import json\ndata = "]


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammars():
    return Grammars.from_folder(demo_model_dir(), 4096, [0])


def engine(kind=None, k=3, draft_masks=True, **config_fields):
    config = VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=k if kind else 0, in_process_drafter=kind,
                            max_context=512, max_running=8, max_batched_tokens=256, prefill_chunk=64, warm_up=False,
                            **config_fields)
    return build_engine(config, in_process_drafter(kind, draft_masks="on" if draft_masks else "off") if kind else None)


def texts(tokenizer, outputs):
    return [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 11)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", DATE)],
                         ids=["json_schema", "regex"])
def test_constrained_output_is_the_same_with_and_without_drafts(tokenizer, spec, temperature, seed):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=seed, grammar=spec)
    plain = engine().generate(prompts, params)
    for kind, masks in (("mtp", True), ("mtp", False), ("ngram", True)):   # mtp with and without draft masks
        spec_engine = engine(kind, draft_masks=masks)
        assert spec_engine.generate(prompts, params) == plain, (kind, masks)
        assert spec_engine.stats.drafted > 0                          # drafts were verified under the masks
    for text in texts(tokenizer, plain):
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(DATE, text), text
    # the same prompts unconstrained are not JSON: the grammar, not the prompt, made them so
    free = texts(tokenizer, engine().generate(prompts, SamplingParams(max_tokens=40, temperature=temperature,
                                                                      seed=seed)))
    assert not any(re.fullmatch(DATE, t) for t in free) and not any(t.startswith("{\"name\"") for t in free)


def test_a_batch_mixing_both_engines_and_free_requests_is_the_same_with_and_without_drafts(tokenizer):
    """JSON (llguidance, its masks filled in parallel; with penalties and logprobs), a regex (xgrammar) and an
    unconstrained request, seeded."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=100, temperature=0.8, seed=21, grammar=GrammarSpec("json_object"),
                             presence_penalty=0.5, logprobs=3),
              SamplingParams(max_tokens=100, temperature=0.8, seed=22, grammar=GrammarSpec("regex", DATE)),
              SamplingParams(max_tokens=30, temperature=0.8, seed=23)]
    plain = engine().generate(prompts, params)
    assert engine("mtp").generate(prompts, params) == plain
    json_text, date, _ = texts(tokenizer, plain)
    assert isinstance(json.loads(json_text), dict) and re.fullmatch(DATE, date)


def test_ignore_eos_still_ends_where_the_grammar_ends(tokenizer):
    params = SamplingParams(max_tokens=200, grammar=GrammarSpec("regex", DATE), ignore_eos=True)
    out = engine("ngram").generate([tokenizer.encode(PROMPTS[0])], params)[0]
    assert out[-1] == 0 and re.fullmatch(DATE, tokenizer.decode(out[:-1])) and len(out) < 20


@pytest.mark.parametrize("spec, text, wrong_next", [(GrammarSpec("regex", DATE), "2024-", "x"),
                                                    (GrammarSpec("json_schema", json.dumps(SCHEMA)), '{"name": "', "\n")],
                         ids=["xgrammar", "llguidance"])
def test_masks_walk_the_drafts_and_roll_back(grammars, tokenizer, spec, text, wrong_next):
    matcher = grammars.matcher(spec)
    good = tokenizer.encode(text)
    refused = tokenizer.encode("x")[0]
    drafts = good[:2] + [refused] + good[2:3]
    masks = masks_array(len(drafts) + 1, 4096)
    matcher.masks(drafts, masks)
    allowed = unpack_mask(masks, 4096)                                            # [k + 1, V]
    assert allowed[0, good[0]] and not allowed[0, refused]
    assert allowed[1, good[1]] and allowed[2].sum() < 4096 and not allowed[2, refused]   # walked the drafts
    assert allowed[3].all() and allowed[4].all()                                   # after the refused draft: open
    again = masks_array(1, 4096)
    matcher.masks([], again)                                                       # rolled back: row 0 as before
    assert torch.equal(unpack_mask(again, 4096)[0], allowed[0])
    both = masks_array(len(drafts) + 2, 4096)                                      # a step's rows, at row 1
    grammars.fill_masks([(matcher, 1, drafts)], both)
    assert both[0].eq(-1).all() and torch.equal(unpack_mask(both[1:], 4096), allowed)
    matcher.accept(good)
    assert not matcher.terminated
    matcher.accept(tokenizer.encode(wrong_next)[:1])                               # refused: the matcher stops
    assert matcher.error and "\n" not in matcher.error


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("spec", [GrammarSpec("regex", "[0-9]+"), GrammarSpec("json_object")],
                         ids=["xgrammar", "llguidance"])
def test_a_draft_the_grammar_refuses_is_never_accepted(grammars, tokenizer, greedy, spec):
    """The target prefers the draft (logit 50), the mask forbids it: rejected; the emitted token is allowed."""
    matcher = grammars.matcher(spec)
    draft = tokenizer.encode("x")[0]
    masks = masks_array(2, 4096)
    matcher.masks([draft], masks)
    logits = torch.zeros(2, 4096)
    logits[:, draft] = 50.0
    rows = VerifyRows(torch.tensor([[draft]]), torch.tensor([1]), torch.tensor([0, 2]), 1)
    sampling = None
    if not greedy:
        from verifier_service.sampler import SamplingBatch
        from verifier_service.sequence import Sequence
        from specdec.models.pinned_upload import PinnedUpload
        seq = Sequence(0, [1, 2], 2, SamplingParams(temperature=1.0, seed=3), seed=3)
        sampling = SamplingBatch.of([seq], [False], 4096, (PinnedUpload("cpu"), PinnedUpload("cpu")))
    verdict = sample(logits, rows, sampling, token_masks=RowMasks(torch.tensor([0, 1]), masks))
    token = int(verdict.tokens[0, 0])
    assert int(verdict.accepted[0]) == 0 and token != draft
    assert unpack_mask(masks, 4096)[0, token]
    unmasked = sample(logits, rows, sampling)                        # the planted defect: no mask, draft accepted
    assert int(unmasked.accepted[0]) == 1


def test_a_failed_grammar_ends_its_request_alone_with_an_error(tokenizer):
    eng = engine("ngram")
    constrained = SamplingParams(max_tokens=60, grammar=GrammarSpec("json_object"))
    eng.add_request("bad", tokenizer.encode(PROMPTS[0]), constrained)
    eng.add_request("free", tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=20, ignore_eos=True))
    outputs = eng.step()                                                  # the prefill
    eng.by_request["bad"].grammar.error = "planted: a parser limit"      # as llguidance reports one
    while eng.has_work:
        outputs += eng.step()
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
    assert reasons == {"bad": "error", "free": "length"}
    forced = engine("ngram", forced_acceptance_length=2.0, unsafe_forced_acceptance=True)
    with pytest.raises(GrammarError, match="forced acceptance"):
        forced.add_request("forced", [1, 2], constrained)


def test_bad_grammars_are_refused_by_name(grammars):
    with pytest.raises(GrammarError, match="does not compile"):
        grammars.compile(GrammarSpec("json_schema", "{not json"))
    with pytest.raises(GrammarError, match="objectx"):
        grammars.compile(GrammarSpec("json_schema", json.dumps({"type": "objectx"})))
    with pytest.raises(GrammarError, match="ebnf"):
        grammars.compile(GrammarSpec("ebnf", "root ::= missing"))
    with pytest.raises(GrammarError, match="structural_tag"):
        grammars.compile(GrammarSpec("structural_tag", '{"type": "nothing"}'))
    with pytest.raises(GrammarError, match="regex"):
        grammars.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(SamplingError, match="grammar kind"):
        SamplingParams(grammar=GrammarSpec("yaml", "x")).validate()
    with pytest.raises(SamplingError, match="needs its text"):
        SamplingParams(grammar=GrammarSpec("regex", " ")).validate()
    with pytest.raises(SamplingError, match="unknown field"):
        SamplingParams.from_fields({"grammar": {"kind": "regex", "text": "a", "extra": 1}})


def test_engine_refuses_a_grammar_without_a_tokenizer(tiny_dir):
    config = VerifierConfig(model_dir=str(tiny_dir), num_drafts=0, max_context=64, warm_up=False)
    with pytest.raises(GrammarError, match="no tokenizer.json"):
        build_engine(config).add_request("r", [1, 2], SamplingParams(grammar=GrammarSpec("json_object")))


@pytest.mark.parametrize("spec", [GrammarSpec("json_object"), GrammarSpec("json_schema", "{}"),
                                  GrammarSpec("regex", "a+"), GrammarSpec("ebnf", 'root ::= "x"'),
                                  GrammarSpec("structural_tag", "{}")])
def test_the_grammar_crosses_the_wire(spec):
    params = SamplingParams(max_tokens=5, grammar=spec)
    assert params_from_proto(params_to_proto(params)) == params


def test_constrained_plain_decoding_overlaps_and_gives_the_same_tokens(tokenizer):
    """Without drafts a constrained step is launched before the last one is read (that one is read between the
    forward and the verdict): the tokens are those of synchronous steps, greedy and seeded, beside a free request
    and one that ends on its length, and the engine did overlap."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    prompts.append(prompts[0])
    params = [SamplingParams(max_tokens=80, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
              SamplingParams(max_tokens=80, temperature=0.8, seed=5, grammar=GrammarSpec("regex", DATE)),
              SamplingParams(max_tokens=9, temperature=0.8, seed=6, grammar=GrammarSpec("json_object")),  # length
              SamplingParams(max_tokens=60, temperature=0.8, seed=7)]                                 # free
    synchronous = dataclasses.replace(VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=0, max_context=512,
                                                     max_running=8, max_batched_tokens=256, prefill_chunk=64,
                                                     warm_up=False), overlap=False)
    expected = build_engine(synchronous).generate(prompts, params)
    tokens, overlapping = _stepped(engine(), prompts, params)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    assert overlapping > 10
    # with drafts (n-gram: on the host) a constrained batch runs synchronous steps
    drafted = engine("ngram")
    drafted.add_request("0", prompts[0], params[0])
    while drafted.has_work:
        drafted.step()
        assert not drafted.overlapping


def _stepped(engine_, prompts, params, abort_at=None) -> tuple[dict[str, list[int]], int]:
    """Run to the end through step(); `abort_at`: (request id, step) to abort. Returns the tokens per request and
    the number of steps that left one launched (overlapped)."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine_.add_request(str(i), prompt, p)
    tokens, steps, overlapping = {str(i): [] for i in range(len(prompts))}, 0, 0
    while engine_.has_work:
        for out in engine_.step():
            tokens[out.request_id] += out.new_token_ids
        steps, overlapping = steps + 1, overlapping + engine_.overlapping
        if abort_at is not None and steps == abort_at[1]:
            engine_.abort(abort_at[0])
    return tokens, overlapping


def test_overlapped_constrained_steps_survive_an_abort_and_preemption(tokenizer):
    """Overlapped constrained decoding with a request aborted mid-run, and with a KV cache small enough that
    sequences are preempted and recomputed: the other requests' tokens are those of synchronous steps alone."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=60, temperature=0.8, seed=8, grammar=GrammarSpec("json_schema",
                                                                                         json.dumps(SCHEMA))),
              SamplingParams(max_tokens=60, temperature=0.8, seed=9, grammar=GrammarSpec("json_object")),
              SamplingParams(max_tokens=60, grammar=GrammarSpec("regex", DATE))]
    base = VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=0, max_context=512, max_running=8,
                          max_batched_tokens=256, prefill_chunk=64, warm_up=False)
    alone, _ = _stepped(build_engine(dataclasses.replace(base, overlap=False)), prompts[:2], params[:2])
    aborted, overlapping = _stepped(engine(), prompts, params, abort_at=("2", 6))
    assert overlapping > 5
    assert [aborted["0"], aborted["1"]] == [alone["0"], alone["1"]] and len(aborted["2"]) < 10
    # 3 blocks of 16 tokens hold either sequence (its JSON ends within 30 tokens) but not both
    tight = build_engine(dataclasses.replace(base, kv_blocks=3, block_size=16))
    squeezed, _ = _stepped(tight, prompts[:2], [dataclasses.replace(p, max_tokens=30) for p in params[:2]])
    assert tight.scheduler.num_preemptions > 0
    assert squeezed == alone

