"""Reduced draft vocabularies (FR-Spec style): the drafter's lm_head over the most frequent target ids only.

Lossless by construction: a drafter restricted to a subset only proposes tokens from it, and the verifier
checks every proposal against the full target distribution as before; only acceptance can drop (when the
target's next token is outside the subset).

The file (JSON), written by `specdec draft-vocab` from a corpus and / or served-token counts (token_counts.py),
read by `specdec drafter --draft-vocab FILE`:
    {"format": "specdec-draft-vocab/1", "vocab_size": V, "token_ids": [sorted ids],
     "tokens_counted": N, "coverage": fraction of the counted tokens inside the subset}
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB_FORMAT = "specdec-draft-vocab/1"


def count_tokens(token_ids: np.ndarray, vocab_size: int, counts: np.ndarray | None = None) -> np.ndarray:
    """Add the occurrences of `token_ids` to `counts` ([vocab_size] int64, new when None)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    added = np.bincount(ids, minlength=vocab_size)
    return added if counts is None else counts.__iadd__(added)


def most_frequent(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent ids (ties: lower id first), sorted by id."""
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"draft vocabulary size must be in [1, {counts.shape[0]}], got {size}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))   # by count descending, then id ascending
    return np.sort(order[:size])


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[ids].sum() / total) if total else 0.0


def save_draft_vocab(path: str | Path, ids: np.ndarray, counts: np.ndarray) -> dict:
    record = {"format": VOCAB_FORMAT, "vocab_size": int(counts.shape[0]), "token_ids": np.sort(ids).tolist(),
              "tokens_counted": int(counts.sum()), "coverage": round(coverage(counts, ids), 6)}
    _write(path, record)
    return record


def load_draft_vocab(path: str | Path, vocab_size: int) -> tuple[int, ...]:
    """The ids of a draft-vocab file, checked against the target's vocabulary size."""
    data = _read(path, VOCAB_FORMAT)
    if data.get("vocab_size") != vocab_size:
        raise ValueError(f"{path}: built for a vocabulary of {data.get('vocab_size')} ids, the target has "
                         f"{vocab_size}")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"{path}: token_ids must be a non-empty list of ids in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: token_ids repeat")
    return tuple(ids)


def _write(path: str | Path, record: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)   # readers never see half a file


def _read(path: str | Path, expected_format: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    if not isinstance(data, dict) or data.get("format") != expected_format:
        raise ValueError(f"{path}: not a {expected_format} file")
    return data
