"""`specdec draft-vocab`: the most frequent target ids of a corpus, and the checks on the file the drafter reads."""
import json

import numpy as np
import pytest

from specdec_tools.cli import main
from specdec.drafting.draft_vocab import count_tokens, load_draft_vocab, most_frequent


def test_most_frequent_keeps_the_top_counts_and_breaks_ties_by_id():
    counts = count_tokens(np.array([3, 3, 3, 7, 7, 1, 9, 9]), 10)
    assert most_frequent(counts, 2).tolist() == [3, 7]
    assert most_frequent(counts, 3).tolist() == [3, 7, 9]  # 9 (2 counts) before 1 (1 count)
    assert most_frequent(np.zeros(5, np.int64), 2).tolist() == [0, 1]
    with pytest.raises(ValueError, match="outside"):
        count_tokens(np.array([10]), 10)


def test_command_counts_a_corpus_with_the_models_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer

    from specdec.demo import demo_model_dir
    text = "def parse(self, text):\n    return text.split()\n" * 50
    (tmp_path / "a.py").write_text(text)
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", "--corpus", str(tmp_path), "--size", "8", "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = Tokenizer.from_file(f"{demo_model_dir()}/tokenizer.json").encode(text).ids
    counts = np.bincount(ids, minlength=4096)
    kept = load_draft_vocab(out, 4096)
    assert summary["tokens_counted"] == len(ids) and summary["size"] == len(kept) == 8
    assert counts[list(kept)].min() >= np.delete(counts, list(kept)).max()   # nothing left out is more frequent
    assert summary["coverage"] == pytest.approx(counts[list(kept)].sum() / len(ids), abs=1e-6)


@pytest.mark.parametrize("record, message", [
    ({"format": "specdec-draft-vocab/1", "vocab_size": 300, "token_ids": [1, 2]}, "vocabulary of 300"),
    ({"format": "specdec-draft-vocab/1", "vocab_size": 4096, "token_ids": [1, 1]}, "repeat"),
    ({"format": "specdec-draft-vocab/1", "vocab_size": 4096, "token_ids": [4096]}, "non-empty list"),
    ({"format": "other", "vocab_size": 4096, "token_ids": [1]}, "not a specdec-draft-vocab/1 file"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, record, message):
    path = tmp_path / "v.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=message):
        load_draft_vocab(path, 4096)


def test_command_refuses_a_corpus_without_text(tmp_path, capsys):
    (tmp_path / "data.bin").write_bytes(b"\0\1")
    assert main(["draft-vocab", "--corpus", str(tmp_path), "-o", str(tmp_path / "v.json")]) == 2
    assert "no text files" in capsys.readouterr().err
