"""The gateway's text side: tokenizer (parity with transformers), incremental detokenizer, stop strings,
request validation. transformers is used here only as the reference; gateway/ never imports it."""
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import TextTokenizer
from gateway.validation import InvalidRequest, TooLong, validate_request
from specdec.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams

REPO = Path(__file__).resolve().parent.parent
FFFD = "\ufffd"
TEXTS = ["hello world", "", "  def f(x):\n\treturn x  # ok\n", "中文 日本語テキスト", "😀 emoji 👍🏽 🇫🇷",
         "é́ combining", "a<|endoftext|>b<|endoftext|>", "<s>x<|im|>y</s>", "\x00\x7f\u200b"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from specdec_tools.tiny import make_tiny
    return Path(make_tiny(tmp_path_factory.mktemp("tok"), preset="tiny", overrides={"vocab_size": 400},
                          tokenizer=True, progress=False))


@pytest.fixture(scope="module")
def fast_dir(tok_dir, tmp_path_factory):
    """Written by PreTrainedTokenizerFast.save_pretrained: a BOS template and extra special tokens."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    out = tmp_path_factory.mktemp("fast")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", bos_token="<s>",
                                   extra_special_tokens=["<|im|>"])
    bos = fast.convert_tokens_to_ids("<s>")
    fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return TextTokenizer.from_folder(tok_dir)


# ---- tokenizer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tok_dir", "fast_dir"])
def test_tokenizer_matches_autotokenizer(which, request):
    from transformers import AutoTokenizer
    folder = request.getfixturevalue(which)
    ref, ours = AutoTokenizer.from_pretrained(str(folder)), TextTokenizer.from_folder(folder)
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 50))]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == ref.eos_token_id is not None
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.vocab_size == len(ref)
    if which == "fast_dir":
        assert ours.encode("x")[0] == ours.bos_token_id  # the file's BOS template is honoured


def test_tokenizer_missing_and_corrupt(tok_dir, tmp_path):
    assert TextTokenizer.from_folder(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        TextTokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    assert TextTokenizer.from_folder(tmp_path).encode("hi") == TextTokenizer.from_folder(tok_dir).encode("hi")


def test_gateway_text_modules_do_not_import_torch():
    code = ("import gateway.tokenizer, gateway.detokenizer, gateway.stop_strings, gateway.validation, sys; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---- detokenizer -------------------------------------------------------------------------------
def _stream(det, ids, rng):
    out, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 5)
        out.append(det.add(ids[i:i + k]))
        i += k
    return out + [det.flush()]


def test_detokenizer_concat_equals_decode(tok):
    rng = random.Random(0)
    words = tok.encode("中文 😀 hello 日本語 🇫🇷👍🏽 é́ def f(x):\n  return x")
    eos = tok.eos_token_id
    for trial in range(1500):
        if trial % 3 == 0:    # anything, byte-level fragments of characters included
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        elif trial % 3 == 1:  # real text cut anywhere, special tokens sprinkled in
            ids = list(words)
            for _ in range(rng.randrange(3)):
                ids.insert(rng.randrange(len(ids) + 1), eos)
        else:                 # real tokens in random order: characters split and left unfinished
            ids = [rng.choice(words + [eos]) for _ in range(rng.randrange(1, 40))]
        n_prompt = rng.randrange(min(8, len(ids))) if trial % 2 else 0
        prompt, gen = ids[:n_prompt], ids[n_prompt:]
        deltas = _stream(IncrementalDetokenizer(tok, prompt), gen, rng)
        full, prompt_text = tok.decode(prompt + gen), tok.decode(prompt).rstrip(FFFD)
        assert prompt_text + "".join(deltas) == full, (prompt, gen)
        if FFFD not in full:
            assert not any(FFFD in d for d in deltas)


def test_detokenizer_holds_split_characters(tok):
    for text in ("😀", "中", "👍🏽", "a日本b"):
        ids = tok.encode(text)
        assert len(ids) > 1
        det = IncrementalDetokenizer(tok)
        deltas = [det.add([i]) for i in ids]
        assert "".join(deltas) == text and not any(FFFD in d for d in deltas)
        assert det.flush() == ""
    ids = tok.encode("x😀")
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:-1]) == "x"        # text before the unfinished emoji is not held
    assert det.num_held_tokens > 0
    assert det.flush() == FFFD             # the stream ended mid-character


def test_detokenizer_prompt_context(tok):
    ids = tok.encode("say 😀 now")
    for cut in range(1, len(ids)):        # including cuts inside the emoji's bytes
        prompt, gen = ids[:cut], ids[cut:]
        det = IncrementalDetokenizer(tok, prompt)
        out = "".join(det.add([i]) for i in gen) + det.flush()
        assert tok.decode(prompt).rstrip(FFFD) + out == "say 😀 now"
    assert IncrementalDetokenizer(tok, ids[:3]).flush() == ""


def test_detokenizer_cost_is_windowed(tok):
    class Counting:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("中文 😀 hello world, def f(x): return x\n" * 40)
    det = IncrementalDetokenizer(Counting(), ids[:100])
    out = "".join(det.add([i]) for i in ids[100:]) + det.flush()
    assert tok.decode(ids[:100]) + out == tok.decode(ids)
    assert len(ids) > 500 and Counting.longest <= 16


# ---- stop strings ------------------------------------------------------------------------------
def _run_stop(stop, text, sizes):
    m, out, i = StopStringMatcher(stop), [], 0
    for k in sizes:
        emitted, hit = m.feed(text[i:i + k])
        out.append(emitted)
        i += k
        if hit:
            return "".join(out), True
    return "".join(out) + m.feed(text[i:])[0] + m.flush(), m.stopped


def _stop_reference(stop, text):
    """Check after every character: cut before the first completed stop string."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    return text, False


@pytest.mark.parametrize("stop,text,expect", [
    (["###"], "answer: 42 ### rest", ("answer: 42 ", True)),
    (["abcd", "bc"], "xabcd", ("xa", True)),          # "bc" completes first
    (["abcd", "bc"], "xabd", ("xabd", False)),        # a held "ab" is released
    (["END", "STOP"], "go ST then STOP", ("go ST then ", True)),
    (["ℵ😀"], "日本ℵ语ℵ😀x", ("日本ℵ语", True)),
    ([], "no stop strings", ("no stop strings", False)),
    (["\n\n"], "line\n", ("line\n", False)),
])
def test_stop_strings(stop, text, expect):
    for sizes in ([len(text)], [1] * len(text), [2, 3, 1, 5, 7, 100]):
        assert _run_stop(stop, text, sizes) == expect


def test_stop_strings_hold_back_and_after_hit():
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("hi <|e") == ("hi ", False) and m.held == "<|e"
    assert m.feed("nd") == ("", False)
    assert m.feed("|> ignored") == ("", True) and m.matched == "<|end|>"
    assert m.feed("more") == ("", True) and m.flush() == ""
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


def test_stop_strings_any_split_property():
    rng = random.Random(1)
    for _ in range(2000):
        stop = ["".join(rng.choice("abé😀") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))]
        text = "".join(rng.choice("abé😀") for _ in range(rng.randrange(15)))
        sizes = [rng.randrange(4) for _ in range(len(text))]
        assert _run_stop(stop, text, sizes) == _stop_reference(stop, text), (stop, text, sizes)


# ---- validation --------------------------------------------------------------------------------
def _validate(prompt="", ids=(5, 6), has_tokenizer=True, vocab=400, ctx=1024, **sampling):
    return validate_request(prompt, list(ids), sampling, has_tokenizer, vocab, ctx)


def test_validation_fills_defaults_and_keeps_what_was_set():
    assert _validate() == SamplingParams()
    assert _validate().max_tokens == DEFAULT_MAX_TOKENS and _validate().top_p == 1.0
    s = _validate(max_tokens=10, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2,
                  presence_penalty=-0.5, frequency_penalty=2.0, seed=3, logprobs=20, stop=["x"],
                  stop_token_ids=[7], ignore_eos=True)
    assert (s.max_tokens, s.top_p, s.min_p, s.repetition_penalty, s.seed, s.logprobs, s.stop, s.stop_token_ids) == \
        (10, 0.9, 0.1, 1.2, 3, 20, ("x",), (7,))
    assert _validate(prompt="hi", ids=()).max_tokens == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt="hi"), "both"),
    (dict(ids=()), "neither"),
    (dict(prompt="hi", ids=(), has_tokenizer=False), "no tokenizer files: send prompt_token_ids"),
    (dict(ids=(1, 400)), "prompt_token_ids"),
    (dict(ids=(-1,)), "prompt_token_ids"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),            # explicit zeros are refused, never read as "unset"
    (dict(top_p=0.0), "top_p"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=2 ** 63), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=["x"], has_tokenizer=False), "stop strings need the model's tokenizer"),
    (dict(seed=2 ** 63), "seed"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["s"] * 17), "stop"),
    (dict(stop=["x" * 257]), "stop"),
    (dict(stop_token_ids=[400]), "stop_token_ids"),
    (dict(bogus=1), "bogus"),
])
def test_validation_rejects(kwargs, field):
    with pytest.raises(InvalidRequest, match=field):
        _validate(**kwargs)


def test_validation_too_long():
    assert _validate(ids=[1] * 1000, max_tokens=24).max_tokens == 24
    with pytest.raises(TooLong, match="max_tokens") as e:
        _validate(ids=[1] * 1000, max_tokens=25)
    assert not isinstance(e.value, InvalidRequest)
    with pytest.raises(TooLong):
        _validate(ids=[1] * 1000)  # the default max_tokens counts too
    with pytest.raises(TooLong):
        validate_request("hi", [], {}, True, 400, 100, prompt_len=90)
    assert validate_request("hi", [], {}, True, 400, 100).max_tokens == DEFAULT_MAX_TOKENS
