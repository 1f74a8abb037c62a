"""A step that is launched and not read yet: the engine launches step n + 1 before it reads step n's tokens, so
the host's work between two steps (reading tokens, stop checks, delivering outputs, scheduling, staging the
next batch) runs while the GPU computes instead of in front of it ("read one step late": docs/architecture.md).

Step n's verdict stays on the device: per sampled sequence its tokens (accepted drafts, then the emitted one),
its accepted count and the drafts the drafter made for step n + 1. The sequences that sampled run in step
n + 1 with that verdict unread (`ChainedInputs`): their input ids are written from it on the device, and
their positions, KV rows and GDN read offsets are moved by the accepted counts (specdec/models/batch_shift.py).
The host copy of the verdict is queued right behind it, so reading it waits for step n only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdec.models.batch_shift import shift_batch
from specdec.models.batch_staging import concat_ranges
from specdec.models.forward_batch import ForwardBatch
from specdec.models.pinned_upload import PinnedUpload

from .sampler import DeviceLogprobs, DeviceVerdict, TokenLogprob
from .scheduler import ScheduledSeq

if TYPE_CHECKING:
    from .drafting_stage import DeviceDraftsAnswer
    from .requests import RequestOutput


@dataclass
class StepResult:
    """What a read step gave one sampled sequence."""
    tokens: list[int]                   # accepted drafts, then the emitted (recovered or bonus) token
    num_accepted: int
    drafts: list[int]                   # the drafter's proposals for its next step (drafted on the device)
    logprobs: list[TokenLogprob] | None = None   # per emitted token, when the request asked


@dataclass
class InFlightStep:
    sampled: list[ScheduledSeq]         # the plan's entries that sample, in verdict-row order
    epochs: list[int]                   # each one's cache epoch at launch
    width: int                          # token columns of the verdict: 1 + the step's most drafts
    accepted: torch.Tensor | None       # [S] int64 device (None: a step without drafts accepts nothing)
    emitted: torch.Tensor | None        # [S] int64 device: each one's last token
    host: torch.Tensor | None           # [S, width + 1] int64 (pinned on CUDA): tokens | accepted
    copied: torch.cuda.Event | None     # recorded after the host copy (CUDA only)
    row_of: dict[int, int]              # seq_id -> its verdict row
    logprobs: DeviceLogprobs | None = None
    # the drafter's next drafts, attached once its answer is in (at once in process; a drafter service's later)
    drafts_answer: DeviceDraftsAnswer | None = None
    draft_counts: list[int] = field(default_factory=list)   # valid drafts per row
    source: torch.Tensor | None = None  # [S + S * K] int64 device: emitted tokens, then the drafts row by row
    drafts_host: torch.Tensor | None = None   # [S, K] (pinned on CUDA)
    drafts_copied: torch.cuda.Event | None = None

    @staticmethod
    def launch(sampled: list[ScheduledSeq], verdict: DeviceVerdict | None,
               epochs: list[int] | None = None) -> "InFlightStep":
        """The verdict on the device (None when nothing samples): queue its copy to the host; no sync. `epochs`:
        the sequences' cache epochs when the forward was queued (default: now)."""
        row_of = {p.seq.seq_id: i for i, p in enumerate(sampled)}
        epochs = epochs if epochs is not None else [p.seq.cache_epoch for p in sampled]
        if verdict is None:
            return InFlightStep(sampled, epochs, 0, None, None, None, None, row_of)
        tokens, accepted = verdict.tokens, verdict.accepted                                   # [S, W], [S]
        emitted = tokens[:, 0] if accepted is None else tokens.gather(1, accepted[:, None])[:, 0]       # [S]
        zeros = torch.zeros(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        result = torch.cat([tokens, zeros if accepted is None else accepted[:, None]], dim=1)  # [S, W + 1]
        host, copied = _to_host(result)
        return InFlightStep(sampled, epochs, tokens.shape[1], accepted, emitted, host, copied, row_of,
                            verdict.logprobs, source=emitted)   # (no drafts until some are attached)

    def attach_drafts(self, drafts: torch.Tensor | None, counts: list[int]) -> None:
        """The drafter's drafts for the sampled rows ([S, K] on the device, or None) and their counts."""
        self.drafts_answer, self.draft_counts = None, counts
        if drafts is None or self.emitted is None:
            self.source = self.emitted
            return
        self.source = torch.cat([self.emitted, drafts.reshape(-1)])
        self.drafts_host, self.drafts_copied = _to_host(drafts)

    @property
    def num_drafts_made(self) -> int:
        """K: draft columns per row in `source` (0 without drafts)."""
        return 0 if self.drafts_host is None else self.drafts_host.shape[1]

    def read(self) -> list[StepResult]:
        """Each sampled sequence's result, in `sampled` order: the step's one host sync (drafts attached)."""
        if self.host is None:
            return []
        for event in (self.copied, self.drafts_copied):
            if event is not None:
                event.synchronize()
        w = self.width
        rows = self.host.tolist()
        accepted = [row[w] for row in rows]
        drafts = self.drafts_host.tolist() if self.drafts_host is not None else [[]] * len(self.sampled)
        logprobs = self.logprobs.read(accepted) if self.logprobs is not None else [None] * len(self.sampled)
        return [StepResult(row[:j + 1], j, d[:count], lp) for row, j, d, count, lp in
                zip(rows, accepted, drafts, self.draft_counts or [0] * len(self.sampled), logprobs)]


def verdict_row(p: ScheduledSeq, previous: InFlightStep | None, num_rows: int) -> int:
    """The unread verdict's row of a sequence with an unread step; num_rows (a zero row appended) for any other."""
    if not p.seq.unread_steps:
        return num_rows
    if previous is None or p.seq.seq_id not in previous.row_of:
        raise RuntimeError(f"sequence {p.seq.seq_id} has an unread token no launched step sampled")
    return previous.row_of[p.seq.seq_id]


def unread_emitted(sampled: list[ScheduledSeq], previous: InFlightStep, upload: PinnedUpload) -> torch.Tensor:
    """[S] tokens each sampled entry emitted in the unread step (accepted + 1; 0 for one it did not sample), on the
    device: a sampled request's draws are keyed by its output position, which the host's count misses by these."""
    unread = len(previous.sampled)
    rows = upload(np.fromiter((verdict_row(p, previous, unread) for p in sampled), np.int64, count=len(sampled)))
    emitted = previous.accepted + 1 if previous.accepted is not None else rows.new_ones(unread)
    return torch.cat([emitted, emitted.new_zeros(1)])[rows]


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of `t` queued behind the work that makes it (pinned, non-blocking on CUDA), and its event."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))
    return host, copied


@dataclass
class LaunchedStep:
    """A step whose forward and verdict are queued on the device."""
    verdict: InFlightStep
    entries: list[ScheduledSeq]
    cached_before: list[int]                # each entry's num_cached before the launch
    hidden: torch.Tensor | None             # its hidden rows, for a drafter asked after the read (else None)
    read_early: list[RequestOutput] | None = None   # the outputs of the step before, read inside this launch
    read_early_seconds: float = 0.0


class ChainedInputs:
    """Step n + 1's inputs that only the device knows: for each planned sequence whose last step is unread,
    its emitted token and drafts (written into the staged input ids) and its accepted count (by which its
    positions, KV rows and GDN read offsets move). Built on the host from the plan and the previous step's row
    numbers; applied to the staged batch before the step runs (`Executor.forward(before=...)`)."""

    def __init__(self, plan: list[ScheduledSeq], previous: InFlightStep | None, upload: PinnedUpload,
                 block_size: int):
        self.block_size = block_size
        lens = np.fromiter((len(p.chunk) for p in plan), np.int64, count=len(plan))
        self.num_tokens, self.num_seqs = int(lens.sum()), len(plan)
        num_rows = 0 if previous is None else len(previous.sampled)
        k = 0 if previous is None else previous.num_drafts_made
        rows = np.fromiter((verdict_row(p, previous, num_rows) for p in plan), np.int64, count=len(plan))  # [B]
        chained = rows < num_rows                                                                          # [B]
        self.empty = not chained.any()
        self.shifts = previous is not None and previous.accepted is not None and not self.empty
        self.max_shift = previous.width - 1 if self.shifts else 0   # the most a read offset moves: drafts verified
        if self.empty:
            return
        # chained sequence b: tokens at starts[b] .. starts[b] + kd[b] take source[rows[b]] (its emitted token),
        # then source[num_rows + rows[b] * k + j] for j < kd[b] (its drafts)
        kd = np.fromiter((p.num_drafts for p in plan), np.int64, count=len(plan))[chained]
        dest = concat_ranges((np.cumsum(lens) - lens)[chained], kd + 1)                                    # [M]
        src = concat_ranges(num_rows + rows[chained] * k - 1, kd + 1)                                      # [M]
        src[np.cumsum(kd + 1) - (kd + 1)] = rows[chained]
        flat = upload(np.concatenate([dest, src] + ([rows] if self.shifts else [])))
        m = dest.shape[0]
        self.dest, self.tokens = flat[:m], previous.source[flat[m:2 * m]]                 # [M], [M]
        if self.shifts:
            accepted = torch.cat([previous.accepted, previous.accepted.new_zeros(1)])      # [S + 1]
            self.shift = accepted[flat[2 * m:]]                                            # [B]

    def __call__(self, batch: ForwardBatch) -> None:
        if self.empty:
            return
        batch.input_ids.index_copy_(0, self.dest, self.tokens)
        if self.shifts:
            shift_batch(batch, self.shift, self.num_tokens, self.num_seqs, self.block_size)
