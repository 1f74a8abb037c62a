"""Grammar masks on the MTP drafter's proposals (issue 40): a constrained sequence's drafts stay inside its grammar,
which raises the acceptance length, and the output stays what plain constrained decoding gives (the exactness
tests of test_structured_outputs.py run the masked and the unmasked drafter). The grammar reaches a drafter
service over the wire; a drafter that cannot follow a sequence's grammar drafts it unmasked."""
import json
import time
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from drafter_service.factory import DrafterConfig
from drafter_service.server import start as start_drafter
from drafter_service.step_session import draft_input_of
from specdec.demo import demo_model_dir
from specdec.drafting import DraftInput, OutputGrammar
from specdec.drafting.draft_masks import DraftMasks
from specdec.grammar import Grammars
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.sampling_params import GrammarSpec, SamplingParams
from specdec_tools.commands.in_process_drafter import in_process_drafter
from verifier_service.builder import VerifierConfig, build_engine
from verifier_service.drafter_client import seq_input_message

pytestmark = pytest.mark.timeout(600)
SCHEMA = GrammarSpec("json_schema", json.dumps({
    "type": "object", "required": ["name", "age", "email", "active", "city"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                   "active": {"type": "boolean"}, "city": {"type": "string"}}}))
PROMPTS = ["# user: describe the config\n\n", "def parse(x):\n    return ", "import json\ndata = ",
           "class Point:\n    def __init__(self, x, y):\n"]


@pytest.fixture(scope="module")
def prompts():
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def grammars():
    return Grammars.from_folder(demo_model_dir(), 4096, [0])


def _engine(masks: bool | None, address: str | None = None):
    """masks None: no drafter; else the in-process MTP drafter (or the drafter service at `address`)."""
    drafting = masks is not None
    config = VerifierConfig(model_dir=str(demo_model_dir()), num_drafts=3 if drafting else 0,
                            in_process_drafter="mtp" if drafting and address is None else None,
                            drafter_address=address, max_context=512, max_running=8, max_batched_tokens=256,
                            prefill_chunk=64, warm_up=False)
    return build_engine(config, in_process_drafter("mtp", draft_masks="on" if masks else "off")
                        if config.in_process_drafter else None)


class Recorder:
    """Wraps a drafter: keeps each sequence's committed tokens and grammar, and counts the proposals the
    grammar refuses after the committed output (checked on a matcher of its own), of the proposals made with the
    sequence's grammar ready."""

    def __init__(self, drafter, grammars):
        self.drafter, self.grammars = drafter, grammars
        self.tokens, self.grammar = {}, {}
        self.num_drafts = self.num_refused = 0

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, batch):
        for s in batch.seqs:
            if s.start_pos == 0:
                self.grammar[s.seq_id] = s.grammar
            self.tokens[s.seq_id] = self.tokens.get(s.seq_id, [])[:s.start_pos] + list(s.token_ids)
        out = self.drafter.propose(batch)
        masks = self.drafter.draft_masks
        for s, drafts in zip(batch.seqs, out.drafts):
            if masks is not None and getattr(masks.tracked.get(s.seq_id), "matcher", None) is None:
                continue   # its grammar was still compiling when it drafted (drafts unmasked by design)
            grammar = self.grammar[s.seq_id]
            matcher = self.grammars.matcher(grammar.spec)
            matcher.accept(self.tokens[s.seq_id][grammar.output_start:])
            walked = 0
            for d in drafts:
                if not matcher.walk(d):
                    self.num_refused += 1
                    break
                walked += 1
            self.num_drafts += len(drafts)
        return out


def test_masked_drafts_follow_the_grammar_and_are_accepted_more(prompts, grammars):
    params = SamplingParams(max_tokens=64, grammar=SCHEMA)
    plain = _engine(None).generate(prompts, params)
    lengths = {}
    for masks in (True, False):
        engine = _engine(masks)
        recorder = engine.drafter = Recorder(engine.drafter, grammars)
        engine.drafting.drafter = recorder
        assert engine.generate(prompts, params) == plain
        assert recorder.num_drafts > 0
        # masked: no draft the grammar refuses; unmasked: the same head proposes some (the check can fail)
        assert (recorder.num_refused == 0) == masks, (masks, recorder.num_refused)
        lengths[masks] = engine.stats.mean_acceptance_length
    assert lengths[True] > lengths[False] + 0.3, lengths


def test_the_grammar_reaches_a_drafter_service_and_its_masks(prompts):
    """Over gRPC: the same output as plain constrained decoding, and the service's masks raise acceptance."""
    params = SamplingParams(max_tokens=48, grammar=SCHEMA)
    plain = _engine(None).generate(prompts, params)
    lengths = {}
    for masks in (True, False):
        server = start_drafter(DrafterConfig("mtp", 3, str(demo_model_dir()), draft_masks="on" if masks else "off"),
                               "127.0.0.1", 0)
        try:
            engine = _engine(masks, f"127.0.0.1:{server.port}")
            deadline = time.monotonic() + 60
            while not engine.drafter.connected:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert engine.generate(prompts, params) == plain
            lengths[masks] = engine.stats.mean_acceptance_length
            engine.drafter.close()
        finally:
            server.stop(0)
    assert lengths[True] > lengths[False] + 0.3, lengths


@pytest.mark.parametrize("grammar", [None, OutputGrammar(GrammarSpec("regex", "[0-9]+"), 5),
                                     OutputGrammar(SCHEMA, 0), OutputGrammar(GrammarSpec("json_object"), 7)])
def test_a_sequences_grammar_crosses_the_wire(grammar):
    sent = DraftInput(9, 0, [1, 2, 3], 3, grammar)
    assert draft_input_of(pb.SeqInput.FromString(seq_input_message(sent).SerializeToString())) == sent


def _step_tokens(walk, logits_rows, previous=None):
    return walk.masked(logits_rows, previous).argmax(-1)


def test_draft_masks_follow_committed_tokens_and_roll_back(grammars):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))
    masks = DraftMasks(grammars)
    digits = GrammarSpec("regex", "ab[0-9]{3}")
    prompt = [5, 6, 7]
    masks.ingest([DraftInput(1, 0, prompt + tokenizer.encode("a"), 3, OutputGrammar(digits, len(prompt))),
                  DraftInput(2, 0, prompt, 3)])                 # sequence 2 is free
    masks.tracked[1].compiling.result()                         # (compiled off this thread)
    walk = masks.walk([2, 1], torch.device("cpu"))
    assert walk.rows == [1]
    flat = torch.zeros(2, 4096)
    first = _step_tokens(walk, flat)
    assert tokenizer.decode([int(first[1])]) == "b"             # after "a", only "b" is allowed
    assert int(first[0]) == 0                                   # the free row is left alone
    digit = walk.masked(flat, first)[1]
    allowed = {tokenizer.decode([t]) for t in torch.nonzero(digit > float("-inf")).flatten().tolist()}
    assert allowed and all(t.isdigit() and len(t) <= 3 for t in allowed), allowed
    walk.close()                                                # back to "a"
    again = DraftMasks.walk(masks, [1], torch.device("cpu"))
    assert tokenizer.decode([int(_step_tokens(again, torch.zeros(1, 4096))[0])]) == "b"
    again.close()
    a, b, one = (tokenizer.encode(c) for c in "ab1")
    masks.ingest([DraftInput(1, len(prompt), a + b + one, 3)])   # overlaps the last call by one token, as sent
    after = DraftMasks.walk(masks, [1], torch.device("cpu"))
    allowed = torch.nonzero(after.masked(torch.zeros(1, 4096), None)[0] > float("-inf")).flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)
    after.close()


def test_a_gap_or_a_bad_grammar_leaves_the_sequence_unmasked(grammars):
    masks = DraftMasks(grammars)
    masks.ingest([DraftInput(1, 0, [5, 6], 3, OutputGrammar(GrammarSpec("regex", "[0-9]+"), 2)),
                  DraftInput(2, 0, [5, 6], 3, OutputGrammar(GrammarSpec("regex", "(unclosed"), 2))])
    masks.tracked[1].compiling.result()
    assert masks.walk([1, 2], torch.device("cpu")).rows == [0]   # the one that does not compile is forgotten
    masks.ingest([DraftInput(1, 9, [3, 4], 3)])                  # positions 3..8 never arrived
    assert masks.walk([1], torch.device("cpu")) is None


@pytest.mark.parametrize("spec, text", [(GrammarSpec("regex", "[0-9]?"), ""),
                                        (GrammarSpec("json_schema", '{"type": "boolean"}'), "tru")],
                         ids=["regex-xgrammar", "json-llguidance"])
def test_a_stop_token_draft_is_kept_and_ends_the_rows_drafts(grammars, spec, text):
    """The row keeps a drafted stop token where the grammar may end, and drafts nothing after it (llguidance takes
    a stop token only as the end: it is checked against the mask, not walked)."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))
    masks = DraftMasks(grammars)
    output = tokenizer.encode(text) if text else []
    masks.ingest([DraftInput(1, 0, [5] + output, 3, OutputGrammar(spec, 1))])
    masks.tracked[1].compiling.result()
    walk = masks.walk([1], torch.device("cpu"))
    drafts, favour_stop = [], torch.zeros(1, 4096)
    favour_stop[0, 0] = 1.0                                       # the stop token (id 0) is the likeliest
    for step in range(3):
        drafts.append(walk.masked(favour_stop, drafts[-1] if drafts else None).argmax(-1))
    kept = walk.counts([3], [int(drafts[-1][0])])[0]
    walk.close()
    ids = [int(d[0]) for d in drafts]
    assert ids[kept - 1] == 0 and 0 not in ids[:kept - 1], ids    # up to the stop token, which is kept
    assert tokenizer.decode(output + ids[:kept - 1]) in ("", "true"), ids


def test_a_row_with_nothing_allowed_in_the_draft_vocabulary_drafts_nothing(grammars):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))
    letters = [t for t in range(1, 4096) if tokenizer.decode([t]).isalpha()]
    vocab_ids = torch.tensor(letters)                             # a draft vocabulary without digits
    masks = DraftMasks(grammars)
    masks.ingest([DraftInput(1, 0, [5], 3, OutputGrammar(GrammarSpec("regex", "[0-9]+"), 1)),
                  DraftInput(2, 0, [5], 3, OutputGrammar(GrammarSpec("regex", "[a-z]+"), 1))])
    for seq_id in (1, 2):
        masks.tracked[seq_id].compiling.result()
    walk = masks.walk([1, 2], torch.device("cpu"), vocab_ids)
    drafts = vocab_ids[walk.masked(torch.zeros(2, len(letters)), None).argmax(-1)]
    assert walk.counts([3, 1], drafts.tolist()) == [0, 1]       # the digit row keeps none, the letters row its one
    walk.close()


@pytest.mark.parametrize("setting, device, eager, wanted", [
    ("auto", "cpu", False, True), ("auto", "cuda", False, False), ("auto", "cuda:1", True, True),
    ("on", "cuda", False, True), ("off", "cpu", False, False)])
def test_draft_masks_by_default_only_where_the_drafter_runs_eagerly(setting, device, eager, wanted):
    assert DraftMasks.wanted(setting, device, eager) == wanted


def test_a_bad_draft_masks_setting_is_refused():
    with pytest.raises(ValueError, match="on, off or auto"):
        DraftMasks.wanted("yes", "cpu", False)


@pytest.mark.gpu
def test_gpu_constrained_output_is_the_same_overlapped_synchronous_and_with_masked_drafts(cuda, prompts):
    """On CUDA (graphs captured, fp32): plain constrained decoding overlapped (the early read) and synchronous,
    and the MTP drafter with and without draft masks (masked steps run eagerly beside the graphs) give the same
    tokens, and they parse as the schema's JSON."""
    import dataclasses

    def engine(masks: str | None, overlap: bool = True):
        config = VerifierConfig(model_dir=str(demo_model_dir()), device=cuda, num_drafts=3 if masks else 0,
                                in_process_drafter="mtp" if masks else None, max_context=512, max_running=8,
                                max_batched_tokens=256, prefill_chunk=64)
        return build_engine(dataclasses.replace(config, overlap=overlap),
                            in_process_drafter("mtp", draft_masks=masks) if masks else None)

    params = SamplingParams(max_tokens=64, grammar=SCHEMA)
    overlapped = engine(None)
    expected = overlapped.generate(prompts, params)
    assert overlapped.executor.runner.graphs is not None and overlapped.executor.runner.graphs.graphs
    assert engine(None, overlap=False).generate(prompts, params) == expected
    for masks in ("on", "off"):
        drafted = engine(masks)
        assert drafted.generate(prompts, params) == expected, masks
        assert drafted.stats.drafted > 0
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))
    for out in expected:
        text = tokenizer.decode(out, skip_special_tokens=True)
        if len(out) < 64:   # (ended by the grammar: complete JSON)
            assert set(json.loads(text)) >= {"name", "age", "email", "active", "city"}, text
