"""The host part of a device step (which sequences, where, how many rows and drafts) and how one step stream
sends it as changes only (drafter.proto, DeviceStep.changes_only).

Both ends of a stream hold the schedule of the last device step sent on it. The next one is that schedule with
the sequences that left removed and, for each sequence that stays, its values predicted:

    start_pos'  = start_pos + chunk_lens      (every row of the step committed)
    max_shift', chunk_lens', num_drafts'      unchanged

Only what the prediction gets wrong travels, as whole entries: the staying sequences whose values differ, and
the new ones with their places in the step's order (the staying ones keep theirs relative to each other). A
steady decoding batch therefore sends nothing but its step counter.

start_pos is the one value allowed to be off: a verifier that reads its steps one step late knows a
sequence's start only up to the accepted drafts it has not read, so it advances by fewer rows than the step
had (its committed rows). The predicted start is kept while it is at least the verifier's and at most
START_POS_SLACK above it, so a drafter's start_pos is an upper bound: enough for reserving cache blocks and for
telling a new sequence (exact 0) from a known one. Drafters take each row's position from the device.

Everything here is host numpy, and no function changes its arguments: a decoded schedule replaces the held
one only once the whole message is known to be good.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

START_POS_SLACK = 64   # how far a predicted start_pos may run ahead of the verifier's (four 16-row KV blocks)
SEQ_IDS, START_POS, MAX_SHIFT, CHUNK_LENS, NUM_DRAFTS = range(5)   # the rows of DeviceSchedule.rows


@dataclass(frozen=True)
class DeviceSchedule:
    """rows [5, B] int64: seq_ids, start_pos (each chunk's first position before the device moves it), max_shift
    (how far the device may move it), chunk_lens (rows of each sequence), num_drafts (proposals wanted)."""
    rows: np.ndarray

    @classmethod
    def of(cls, seq_ids, start_pos, max_shift, chunk_lens, num_drafts) -> "DeviceSchedule":
        rows = np.array([seq_ids, start_pos, max_shift, chunk_lens, num_drafts], dtype=np.int64)
        return cls(rows.reshape(5, -1))

    seq_ids = property(lambda self: self.rows[SEQ_IDS])
    start_pos = property(lambda self: self.rows[START_POS])
    max_shift = property(lambda self: self.rows[MAX_SHIFT])
    chunk_lens = property(lambda self: self.rows[CHUNK_LENS])
    num_drafts = property(lambda self: self.rows[NUM_DRAFTS])

    def __len__(self) -> int:
        return self.rows.shape[1]

    def take(self, index: np.ndarray) -> "DeviceSchedule":
        """The entries at `index` (a mask or indices), in that order."""
        return DeviceSchedule(self.rows[:, index])

    def predicted(self) -> "DeviceSchedule":
        """The next step's entries of these sequences, if nothing changes but every row commits."""
        rows = self.rows.copy()
        rows[START_POS] += rows[CHUNK_LENS]
        return DeviceSchedule(rows)

    @staticmethod
    def merge(staying: "DeviceSchedule", new: "DeviceSchedule", placed: np.ndarray) -> "DeviceSchedule":
        """`new` at the indices `placed` (ascending) of the result, `staying` in order around them."""
        if not len(new):
            return staying
        rows = np.empty((5, len(staying) + len(new)), np.int64)
        where = np.ones(rows.shape[1], bool)
        where[placed] = False
        rows[:, where], rows[:, placed] = staying.rows, new.rows
        return DeviceSchedule(rows)


@dataclass(frozen=True)
class ScheduleChanges:
    removed: np.ndarray       # [R] int64 ascending indices into the held schedule: sequences that left
    given: DeviceSchedule     # whole entries: staying sequences whose prediction is off, then the new ones
    placed: np.ndarray        # [N] int64 ascending: each new sequence's index in this step's order


def changes_between(held: DeviceSchedule | None, current: DeviceSchedule
                    ) -> tuple[ScheduleChanges | None, DeviceSchedule]:
    """(the changes that turn `held` into `current`, or None when they cannot: send `current` whole; the schedule
    the other end then holds). That schedule equals `current` but for start_pos values the prediction kept."""
    if held is None:
        return None, current
    same = len(held) == len(current) and np.array_equal(held.seq_ids, current.seq_ids)   # (the usual step)
    stays = np.ones(len(held), bool) if same else np.isin(held.seq_ids, current.seq_ids)   # [B_held]
    known = np.ones(len(current), bool) if same else np.isin(current.seq_ids, held.seq_ids)   # [B]
    if not same and not np.array_equal(current.seq_ids[known], held.seq_ids[stays]):
        return None, current      # the staying sequences in another order
    guess = (held if same else held.take(stays)).predicted()
    now = current if same else current.take(known)
    off = _off(guess, now)                                                             # [S]
    placed = np.flatnonzero(~known)
    new = current.take(placed)
    given = DeviceSchedule(np.concatenate([now.rows[:, off], new.rows], axis=1))
    holds = DeviceSchedule(np.where(off, now.rows, guess.rows))
    return ScheduleChanges(np.flatnonzero(~stays), given, placed), DeviceSchedule.merge(holds, new, placed)


def _off(guess: DeviceSchedule, now: DeviceSchedule) -> np.ndarray:
    """[S] where the prediction does not hold: another value, or a start the guess is not within the slack
    above (a start of 0, "afresh", is always given)."""
    ahead = (guess.start_pos - now.start_pos).astype(np.uint64)     # (negative: huge)
    return (guess.rows[MAX_SHIFT:] != now.rows[MAX_SHIFT:]).any(0) | (ahead > START_POS_SLACK) | \
        (now.start_pos == 0)


def apply_changes(held: DeviceSchedule | None, changes: ScheduleChanges) -> DeviceSchedule:
    """The schedule `changes` describe (raises ValueError, naming what is wrong, for changes that do not fit)."""
    if held is None:
        raise ValueError("changes_only, but no device step came before it on this stream")
    removed, given, placed = changes.removed, changes.given, changes.placed
    if not len(removed) and not len(given) and not len(placed):
        return held.predicted()                    # (the usual step)
    if len(removed) and (removed.min() < 0 or removed.max() >= len(held) or (np.diff(removed) <= 0).any()):
        raise ValueError(f"removed: indices must be ascending, once each, below {len(held)} (the last step's "
                         "sequences)")
    if len(np.unique(given.seq_ids)) != len(given):
        raise ValueError("a seq_id is given twice")
    if len(removed):
        stays = np.ones(len(held), bool)
        stays[removed] = False
        held = held.take(stays)
    guess = held.predicted()
    match = given.seq_ids[:, None] == guess.seq_ids[None, :]                          # [G, S]
    override = match.any(1)                                                            # [G]
    new = given.take(~override)
    if len(placed) != len(new) or (len(placed) and (placed.min() < 0 or placed.max() >= len(guess) + len(new)
                                                    or (np.diff(placed) <= 0).any())):
        raise ValueError(f"placed: one ascending index per new sequence ({len(new)}), below "
                         f"{len(guess) + len(new)}")
    if override.any():
        guess.rows[:, match[override].argmax(1)] = given.rows[:, override]
    return DeviceSchedule.merge(guess, new, placed)
