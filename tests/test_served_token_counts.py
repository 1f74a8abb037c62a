"""Token counts over served traffic (`specdec drafter --count-tokens`, `specdec draft-vocab --counts`): the
counting rule on the drafter's inputs, the file across restarts, the drafter service end to end, and the
draft vocabulary built from a counts file."""
import json
import logging
import time
from collections import defaultdict

import numpy as np
import pytest
import torch
from engine_factory import make_engine, random_prompts

from drafter_service.factory import DrafterConfig
from drafter_service.server import start as start_drafter
from specdec_tools.cli import main
from specdec.drafting import DraftInput
from specdec.drafting.draft_vocab import load_draft_vocab, most_frequent
from specdec.drafting.token_counts import TokenCounter, load_token_counts, save_token_counts
from specdec.sampling_params import SamplingParams
from verifier_service.drafter_client import RemoteDrafter
from verifier_service.drafter_link import DrafterLinkConfig

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def expected_counts(ids, vocab=100):
    return np.bincount(np.asarray(ids, np.int64), minlength=vocab)


def test_counts_only_the_generated_tokens_of_each_step(tmp_path):
    """Prompt steps count their one generated token (a chunked prompt's earlier chunks nothing); later steps
    skip the repeated first token; a recomputed sequence (start_pos 0 again) counts only its new token."""
    counter = TokenCounter(tmp_path / "c.json", 100)
    counter.add([DraftInput(1, 0, [5, 6, 7, 20], 3),              # short prompt + first generated
                 DraftInput(2, 0, [1, 2, 3, 4, 5], 0)])           # first chunk of a long prompt
    counter.add([DraftInput(1, 3, [20, 21, 9, 9], 3),             # verify step: 3 committed
                 DraftInput(2, 4, [5, 6, 7, 30], 3)])             # last prompt chunk + first generated
    counter.add([DraftInput(1, 6, [9, 22], 0),                    # one left to generate: no drafts asked
                 DraftInput(2, 7, [30, 31, 32], 3)])
    counter.add([DraftInput(2, 0, [1, 2, 3, 4, 5, 6, 7, 30, 31, 32, 33], 3)])  # recomputed
    want = expected_counts([20, 21, 9, 9, 30, 22, 31, 32, 33])
    assert counter.counts.tolist() == want.tolist() and counter.added == 9


def test_counts_are_saved_reloaded_and_added_to_across_restarts(tmp_path):
    path, clock = tmp_path / "counts.json", Clock()
    counter = TokenCounter(path, 100, save_every_s=60, clock=clock)
    counter.add([DraftInput(1, 0, [5, 7], 3)])
    clock.now = 59.0
    counter.add([DraftInput(1, 1, [7, 8, 8], 3)])
    assert not path.exists()                                     # not due yet
    clock.now = 60.0
    counter.add([DraftInput(1, 3, [8, 3], 3)])
    assert json.loads(path.read_text()) == {"format": "specdec-token-counts/1", "vocab_size": 100,
                                            "tokens_counted": 4, "token_ids": [3, 7, 8], "counts": [1, 1, 2]}
    counter.add([DraftInput(1, 4, [3, 99], 3)])
    counter.close()
    assert load_token_counts(path, 100).tolist() == expected_counts([7, 8, 8, 3, 99]).tolist()

    again = TokenCounter(path, 100)                              # a restart adds to what was counted
    again.add([DraftInput(4, 0, [1, 7], 3)])
    again.close()
    assert load_token_counts(path, 100).tolist() == expected_counts([7, 8, 8, 3, 99, 7]).tolist()
    assert again.added == 1 and not (tmp_path / "counts.json.tmp").exists()
    with pytest.raises(ValueError, match=f"{path}: counts for a vocabulary of 100 ids, the target has 4096"):
        TokenCounter(path, 4096)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not JSON"),
    (json.dumps({"format": "specdec-draft-vocab/1", "vocab_size": 100}), "not a specdec-token-counts/1 file"),
    (json.dumps({"format": "specdec-token-counts/1", "vocab_size": 100, "tokens_counted": 1, "token_ids": [1],
                 "counts": [1, 2]}), "same length"),
    (json.dumps({"format": "specdec-token-counts/1", "vocab_size": 100, "tokens_counted": 1, "token_ids": [100],
                 "counts": [1]}), r"distinct ids in \[0, 100\)"),
    (json.dumps({"format": "specdec-token-counts/1", "vocab_size": 100, "tokens_counted": 2, "token_ids": [4, 4],
                 "counts": [1, 1]}), "distinct ids"),
    (json.dumps({"format": "specdec-token-counts/1", "vocab_size": 100, "tokens_counted": 0, "token_ids": [4],
                 "counts": [0]}), "positive integers"),
    (json.dumps({"format": "specdec-token-counts/1", "vocab_size": 100, "tokens_counted": 5, "token_ids": [4],
                 "counts": [2]}), "not the sum of counts"),
])
def test_malformed_counts_files_are_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        TokenCounter(path, 100)
    assert str(path) in str(e.value)


def test_the_drafter_service_counts_the_tokens_its_verifier_generates(tiny_model, tmp_path, caplog):
    """A real drafter service (ngram) behind a verifier's engine; prompts longer than the prefill chunk (8)
    come in several chunks. The drafter never sees the tokens of a sequence's final step (the sequence has
    ended), so the file must hold exactly the generated tokens of every other step."""
    caplog.set_level(logging.INFO)
    path, vocab = tmp_path / "served.json", tiny_model.config.vocab_size
    running = start_drafter(DrafterConfig("ngram", 3, count_tokens=str(path), vocab_size=vocab,
                                          count_every_s=3600), "127.0.0.1", 0)
    m = tiny_model.model
    remote = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{running.port}", 3, "inline", 10.0, max_backoff_s=0.5),
                           tiny_model.config.hidden_size, vocab, m.embed_tokens.weight.dtype, torch.device("cpu"),
                           512, {}, tiny_model.config.model_type)
    try:
        deadline = time.monotonic() + 30
        while not remote.connected:
            assert time.monotonic() < deadline, "the verifier did not connect to the drafter"
            time.sleep(0.05)
        engine = make_engine(tiny_model, remote, 3, chunk=8)
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        for i, prompt in enumerate(random_prompts([5, 19, 11], vocab, seed=3)):
            engine.add_request(f"r{i}", prompt, params)
        steps = defaultdict(list)
        while engine.has_work:
            for out in engine.step():
                steps[out.request_id].append(out.new_token_ids)
        assert engine.stats.accepted > 0 and engine.fallback_steps == 0  # steps of several tokens, all drafted
        assert not path.exists()                                         # not due before the server stops
    finally:
        remote.close()
        running.stop(0)
    counted = [t for outs in steps.values() for out in outs[:-1] for t in out]
    assert all(sum(map(len, outs)) == 20 for outs in steps.values())
    assert load_token_counts(path, vocab).tolist() == np.bincount(counted, minlength=vocab).tolist()
    assert f"counted {len(counted)} served tokens this run ({len(counted)} in all) into {path}" in caplog.text


def test_draft_vocab_from_counts_files_alone_and_with_a_corpus(tmp_path, capsys):
    from tokenizers import Tokenizer

    from specdec.demo import demo_model_dir
    served = np.zeros(4096, np.int64)
    served[[4000, 4001, 12]] = [900, 800, 5]
    save_token_counts(tmp_path / "served.json", served)
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", "--counts", str(tmp_path / "served.json"), "--size", "2", "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert load_draft_vocab(out, 4096) == (4000, 4001)
    assert summary["tokens_counted"] == summary["served_tokens"] == 1705 and summary["corpus_tokens"] == 0

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = "def parse(self, text):\n    return text.split()\n" * 50
    (corpus / "a.py").write_text(text)
    assert main(["draft-vocab", "--corpus", str(corpus), "--counts", str(tmp_path / "served.json"), "--size", "8",
                 "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = Tokenizer.from_file(f"{demo_model_dir()}/tokenizer.json").encode(text).ids
    both = np.bincount(ids, minlength=4096) + served
    kept = load_draft_vocab(out, 4096)
    assert list(kept) == most_frequent(both, 8).tolist() and {4000, 4001} < set(kept)
    assert summary["tokens_counted"] == len(ids) + 1705 and summary["corpus_tokens"] == len(ids)
    assert summary["counts_files"] == 1 and summary["files"] == 1


def test_draft_vocab_refuses_no_input_and_counts_of_another_vocabulary(tmp_path, capsys):
    assert main(["draft-vocab", "-o", str(tmp_path / "v.json")]) == 2
    assert "give --corpus PATH (text) and/or --counts FILE" in capsys.readouterr().err
    save_token_counts(tmp_path / "other.json", np.ones(300, np.int64))
    assert main(["draft-vocab", "--counts", str(tmp_path / "other.json"), "-o", str(tmp_path / "v.json")]) == 2
    assert "other.json: counts for a vocabulary of 300 ids, the target has 4096" in capsys.readouterr().err


def test_drafter_command_passes_the_counting_config_down(tmp_path, monkeypatch, capsys):
    import drafter_service.server
    configs = []
    monkeypatch.setattr(drafter_service.server, "serve", lambda config, host, port: configs.append(config))
    monkeypatch.delenv("SPECDEC_MODEL", raising=False)
    path = str(tmp_path / "c.json")
    assert main(["drafter", "--kind", "ngram", "--vocab-size", "257", "--count-tokens", path,
                 "--count-every", "5"]) == 0
    assert main(["drafter", "--kind", "mtp", "--device", "cpu", "--count-tokens", path]) == 0  # demo model's vocab
    assert [(c.count_tokens, c.count_every_s, c.vocab_size) for c in configs] == [(path, 5.0, 257),
                                                                                 (path, 60.0, 4096)]
    assert main(["drafter", "--kind", "ngram", "--count-tokens", path]) == 2
    assert "--count-tokens needs the target's vocabulary size" in capsys.readouterr().err


def test_a_failed_save_never_stops_counting_and_a_missing_folder_is_refused_at_start(tmp_path, caplog):
    with pytest.raises(ValueError, match="does not exist"):
        TokenCounter(tmp_path / "no-such-folder" / "counts.json", 100)
    path, clock = tmp_path / "counts.json", Clock()
    counter = TokenCounter(path, 100, save_every_s=60, clock=clock)
    (tmp_path / "counts.json.tmp").mkdir()          # the atomic write's temporary file cannot be created
    clock.now = 61.0
    with caplog.at_level(logging.ERROR):
        counter.add([DraftInput(1, 0, [7, 8, 9], 3)])   # a prompt + its first token; the save fails, is logged
    assert "could not save the token counts" in caplog.text
    assert counter.counts[9] == 1 and not path.exists()
    (tmp_path / "counts.json.tmp").rmdir()
    clock.now = 122.0
    counter.add([DraftInput(1, 2, [9, 10, 11], 3)])   # counting went on; this save works
    assert load_token_counts(path, 100)[[8, 9, 10, 11]].tolist() == [0, 1, 1, 1]
