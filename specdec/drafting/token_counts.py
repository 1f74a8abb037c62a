"""Counts of the tokens a served target generates, gathered by the drafter service (`specdec drafter
--count-tokens FILE`) from what the verifier commits, for `specdec draft-vocab --counts FILE`.

The counting rule (the drafter sees each sequence as DraftInputs, see interface.py):
- A decoding sequence's call repeats the newest committed token of its previous call first: count
  `token_ids[1:]`.
- A sequence that starts at start_pos = 0 (new, recomputed, or re-sent to a new drafter) is prefilling: its
  tokens are the prompt (or context counted before). Chunks that ask for no drafts are prompt chunks (long
  prompts come in several): nothing is counted. The first chunk that asks for drafts completes the prefill and
  ends with the one token generated after it: count `token_ids[-1]`, and from then on `token_ids[1:]`.
  A short prompt is one chunk: (start_pos 0, prompt + [first generated], num_drafts > 0) counts the last token.
  A context re-sent from position 0 (the drafter lost it) counts only its newest token: what the verifier
  committed in that step besides it is not counted.
- Never counted, because the drafter never sees them: the tokens of the step that ends a sequence (EOS and
  stop tokens included), tokens committed while no drafter was connected, and the first token of a request
  whose first chunk asks for no drafts (max_tokens <= 2).

The file (JSON, written atomically, read back and added to when the drafter starts again):
    {"format": "specdec-token-counts/1", "vocab_size": V, "tokens_counted": N,
     "token_ids": [ids with a count, ascending], "counts": [their counts]}
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from .draft_vocab import _read, _write

log = logging.getLogger(__name__)
COUNTS_FORMAT = "specdec-token-counts/1"


def save_token_counts(path: str | Path, counts: np.ndarray) -> None:
    ids = np.flatnonzero(counts)
    _write(path, {"format": COUNTS_FORMAT, "vocab_size": int(counts.shape[0]), "tokens_counted": int(counts.sum()),
                  "token_ids": ids.tolist(), "counts": counts[ids].tolist()})


def load_token_counts(path: str | Path, vocab_size: int) -> np.ndarray:
    """[vocab_size] int64 counts of a counts file, checked against the target's vocabulary size."""
    data = _read(path, COUNTS_FORMAT)
    if data.get("vocab_size") != vocab_size:
        raise ValueError(f"{path}: counts for a vocabulary of {data.get('vocab_size')} ids, the target has "
                         f"{vocab_size}")
    ids, counts = data.get("token_ids"), data.get("counts")
    if not (isinstance(ids, list) and isinstance(counts, list) and len(ids) == len(counts)):
        raise ValueError(f"{path}: token_ids and counts must be lists of the same length")
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{path}: token_ids must be distinct ids in [0, {vocab_size})")
    if not all(isinstance(c, int) and c > 0 for c in counts):
        raise ValueError(f"{path}: counts must be positive integers")
    if data.get("tokens_counted") != sum(counts):
        raise ValueError(f"{path}: tokens_counted {data.get('tokens_counted')} is not the sum of counts "
                         f"({sum(counts)})")
    out = np.zeros(vocab_size, np.int64)
    out[np.asarray(ids, np.int64)] = counts
    return out


class TokenCounter:
    """Counts the generated tokens of the DraftInputs it is given (the rule above); saves every
    `save_every_s` seconds (checked in `add`, no thread) and on `close`. An existing file is added to."""

    def __init__(self, path: str | Path, vocab_size: int, save_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if vocab_size < 1:
            raise ValueError(f"counting tokens needs the target's vocabulary size, got {vocab_size}")
        self.path, self.save_every_s, self._clock = Path(path), save_every_s, clock
        if not self.path.parent.is_dir():
            raise ValueError(f"--count-tokens {path}: folder {self.path.parent} does not exist")
        exists = self.path.exists()
        self.counts = load_token_counts(path, vocab_size) if exists else np.zeros(vocab_size, np.int64)
        self.added, self.dropped = 0, 0         # this run: tokens counted, ids outside the vocabulary
        self._decoding: set[int] = set()        # seq ids past their prefill
        self._saved_at, self._dirty = clock(), False
        log.info("counting served tokens into %s (%s)", path,
                 f"adding to {int(self.counts.sum())} counted before" if exists else "new file")

    def add(self, seqs: Iterable) -> None:
        """One drafter step's DraftInputs (seq_id, start_pos, token_ids, num_drafts)."""
        ids = [t for s in seqs for t in self._generated(s)]
        if ids:
            self._count(np.asarray(ids, np.int64))
        if self._dirty and self._clock() - self._saved_at >= self.save_every_s:
            try:
                self.save()
            except OSError as e:   # counting must never stop drafting: keep counting, try again later
                self._saved_at = self._clock()
                log.error("could not save the token counts to %s (%s): retrying in %.0f s", self.path, e,
                          self.save_every_s)

    def _generated(self, s) -> list[int]:
        if s.start_pos == 0:
            self._decoding.discard(s.seq_id)
        if s.seq_id in self._decoding:
            return s.token_ids[1:]
        if s.num_drafts == 0:
            return []                           # a prompt chunk
        self._decoding.add(s.seq_id)
        return s.token_ids[-1:]                 # the prefill is complete: its one generated token

    def _count(self, ids: np.ndarray) -> None:
        inside = (ids >= 0) & (ids < self.counts.shape[0])
        if not inside.all():
            if not self.dropped:
                log.warning("token ids outside the counted vocabulary of %d ids: not counted (is --vocab-size "
                            "the target's?)", self.counts.shape[0])
            self.dropped += int((~inside).sum())
            ids = ids[inside]
        np.add.at(self.counts, ids, 1)
        self.added += int(ids.size)
        self._dirty = True

    def release(self, seq_ids: Iterable[int]) -> None:
        self._decoding.difference_update(seq_ids)

    def clear(self) -> None:
        self._decoding.clear()

    def save(self) -> None:
        save_token_counts(self.path, self.counts)
        self._saved_at, self._dirty = self._clock(), False

    def close(self) -> None:
        self.save()
        log.info("counted %d served tokens this run (%d in all) into %s", self.added, int(self.counts.sum()),
                 self.path)
