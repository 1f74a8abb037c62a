"""Drafting on the device, chained to the verifier's step without a host round trip (in-process drafters).

With overlapped steps the verifier launches step n + 1 before it reads step n: how many drafts each sequence
accepted, its next token and its new drafts stay on the device. A drafter that implements `DraftsOnDevice` is
called right after the verify step is queued, with the step's batch as the device holds it, and queues its
own work behind it; its drafts go into step n + 1's input ids on the device. Nothing in the call may read a
device value on the host (no sync).

Per sequence b of the step (the target's batch layout: flat tokens, cu = exclusive cumsum of chunk_lens):
    rows cu[b] .. cu[b] + chunk_lens[b] - 1 at positions[...] (already moved by the unread step's accepted
    counts), of which the first committed[b] are committed (device [B]);
    pair i = (token at position p_i + 1, target hidden at p_i), i < committed[b]: the token is
    input_ids[cu[b] + i + 1] for i < committed[b] - 1, and next_token[b] for the last one
    (the token the verifier just emitted, or the next prompt token of a prefill chunk).
Rows past committed[b] are rejected drafts: a drafter may run them (what it writes there is overwritten by its
next call before anything reads it) but must not use them. start_pos[b] == 0 starts the sequence afresh.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np
import torch

from .device_schedule import DeviceSchedule
from .interface import PrefixBlocks


@dataclass
class DeviceDraftStep:
    step: int
    seq_ids: list[int]             # [B]
    start_pos: np.ndarray          # [B] int64 host: each chunk's first position before the device moves it
                                   # (through a drafter service: at most 64 above it, never below, exact where 0;
                                   # device_schedule.py)
    max_shift: np.ndarray          # [B] int64 host: how far the device may move it (the unread step's drafts)
    chunk_lens: np.ndarray         # [B] int64 host: rows of each sequence in the batch
    num_drafts: np.ndarray         # [B] int64 host: proposals wanted (0: ingest only)
    input_ids: torch.Tensor        # [>= T] int64 device: the step's tokens (drafts included); valid within the call
    positions: torch.Tensor        # [>= T] int64 device: their positions
    hidden: torch.Tensor           # [T, H] the target's hidden rows after its final norm
    committed: torch.Tensor        # [B] int64 device: committed rows of each sequence
    next_token: torch.Tensor       # [B] int64 device: the token after each sequence's last committed row
    prefixes: list[PrefixBlocks] = field(default_factory=list)   # prefix caching (interface.py), for some of them

    @property
    def num_tokens(self) -> int:
        return int(self.chunk_lens.sum())

    @property
    def schedule(self) -> DeviceSchedule:
        return DeviceSchedule.of(self.seq_ids, self.start_pos, self.max_shift, self.chunk_lens, self.num_drafts)


@dataclass
class DeviceDrafts:
    tokens: torch.Tensor           # [B, K] int64 on the device, valid until the drafter's next call
    counts: list[int]              # [B] how many of each row are proposals (<= num_drafts; 0 where it cannot)
    missing: list[int] = field(default_factory=list)   # seq ids whose earlier context it lacks (as DraftOutput)
    failure: str = ""              # non-empty: no drafts this step, and why


@runtime_checkable
class DraftsOnDevice(Protocol):
    """A drafter that drafts from device tensors and answers with device tensors (no sync): an in-process one
    (the MTP head), or the drafter service's link when the drafter it reaches takes device steps."""
    drafts_on_device: bool        # it can right now (a link: connected to a drafter that takes device steps)

    def draft_on_device(self, step: DeviceDraftStep) -> DeviceDrafts: ...


@runtime_checkable
class DraftsOnDeviceLater(Protocol):
    """A DraftsOnDevice drafter whose answer can be read later than it is asked for (the drafter service's link:
    the step is sent at once, the answer read at the start of the verifier's next step). `draft_on_device(step)`
    equals `draft_on_device_later(step)()`."""

    def draft_on_device_later(self, step: DeviceDraftStep) -> Callable[[], DeviceDrafts]: ...
