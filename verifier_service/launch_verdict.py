"""The verdict of a launched step, left on the device, and what the drafter chained to it gets.

For an overlapped step no request has penalties or logprobs: when all are greedy the verdict is `greedy_accept`
over the step's logit rows, else the sampled rule of launch_sampling; either way with the drafts read back from
the staged input ids on the device (they may have been written there from the unread step before, never seen by
the host). No host read: the engine copies the verdict to the host after queueing the next work, and reads it
one step later.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import cu_rows_of, greedy_accept
from specdec.drafting import DeviceDraftStep
from specdec.models.forward_batch import ForwardBatch
from specdec.models.pinned_upload import PinnedUpload

from .in_flight import InFlightStep
from .launch_sampling import launched_sample
from .scheduler import ScheduledSeq


def launch_verdict(plan: list[ScheduledSeq], logits: torch.Tensor, batch: ForwardBatch, forced: list[int] | None,
                   upload: PinnedUpload, previous: InFlightStep | None = None,
                   sampling_uploads: tuple[PinnedUpload, PinnedUpload] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [S, W] padded with -1, accepted [S] or None when no sequence verifies drafts) on the device, for
    the plan's sampled entries in order. logits [R, V]: k_b + 1 rows per sampled sequence. Requests that sample
    (temperature > 0) are decided by launch_sampling with `previous` (the unread step) and `sampling_uploads`."""
    sampled = [(at, p) for at, p in zip(_chunk_starts(plan), plan) if p.samples]
    num_drafts = np.fromiter((p.num_drafts for _, p in sampled), np.int64, count=len(sampled))
    width = int(num_drafts.max(initial=0))
    draws = any(not p.seq.params.greedy for _, p in sampled)
    if width == 0 and not draws:
        return logits.argmax(-1)[:, None], None
    s, cols = len(sampled), np.arange(width)[None, :]
    starts = np.fromiter((at + 1 for at, _ in sampled), np.int64, count=s)
    where = np.where(cols < num_drafts[:, None], starts[:, None] + cols, -1)           # [S, K] flat draft index
    host = [where.ravel(), num_drafts, cu_rows_of(num_drafts)]
    host += [] if forced is None else [np.asarray(forced, np.int64)]
    flat = upload(np.concatenate(host))                                                # SK + S + S + 1 (+ S)
    index, at = flat[:s * width].view(s, width), s * width
    num_drafts_dev, cu_rows = flat[at:at + s], flat[at + s:at + 2 * s + 1]
    drafts = torch.where(index >= 0, batch.input_ids[index.clamp(min=0)], -1)          # [S, K]
    forced_accepts = None if forced is None else flat[at + 2 * s + 1:]
    if not draws:
        return greedy_accept(logits.argmax(-1), drafts, num_drafts_dev, cu_rows, forced_accepts)
    tokens, accepted = launched_sample(logits, [p for _, p in sampled], drafts, num_drafts_dev, forced_accepts,
                                       previous, sampling_uploads)
    return tokens, accepted if width else None


def chained_draft_step(step: int, plan: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor,
                       emitted: torch.Tensor | None, accepted: torch.Tensor | None, max_drafts: int,
                       upload: PinnedUpload) -> tuple[DeviceDraftStep, torch.Tensor]:
    """What an on-device drafter gets for this step: every sequence's committed rows (its chunk less the drafts
    it did not accept) and the token after them (`emitted` [S] by the verdict, or the next prompt token). Also
    returns the sampled entries' places in the plan, [S] on the device."""
    b = len(plan)
    sampled = np.fromiter((i for i, p in enumerate(plan) if p.samples), np.int64)
    chunk_lens = np.fromiter((len(p.chunk) for p in plan), np.int64, count=b)
    base = chunk_lens - np.fromiter((p.num_drafts for p in plan), np.int64, count=b)   # committed before drafts
    following = np.fromiter((_next_prompt_token(p) for p in plan), np.int64, count=b)
    flat = upload(np.concatenate([base, following, sampled]))
    base_dev, next_dev, sampled_dev = flat[:b], flat[b:2 * b], flat[2 * b:]
    committed = base_dev if accepted is None else base_dev.index_add(0, sampled_dev, accepted)
    next_token = next_dev if emitted is None else next_dev.index_copy(0, sampled_dev, emitted)
    wanted = np.array([max_drafts if p.samples else 0 for p in plan], np.int64)
    return DeviceDraftStep(
        step=step, seq_ids=[p.seq.seq_id for p in plan],
        start_pos=np.fromiter((p.seq.num_cached for p in plan), np.int64, count=b),
        max_shift=np.fromiter((p.seq.unread_accepts for p in plan), np.int64, count=b),
        chunk_lens=chunk_lens, num_drafts=wanted, input_ids=batch.input_ids, positions=batch.positions,
        hidden=hidden, committed=committed, next_token=next_token), sampled_dev


def _chunk_starts(plan: list[ScheduledSeq]) -> list[int]:
    starts, at = [], 0
    for p in plan:
        starts.append(at)
        at += len(p.chunk)
    return starts


def _next_prompt_token(p: ScheduledSeq) -> int:
    """The token after a prefill chunk that does not sample (the prompt goes on); 0 where the verdict decides."""
    if p.samples:
        return 0
    return p.seq.token_ids[p.seq.num_cached + len(p.chunk)]
