"""The speculative rule of a launched (overlapped) step whose requests sample: rejection_sample's device part
(`decide_on_device`) for requests without penalties or logprobs, with nothing read from the device.

The draws are keyed by (seed, output position); row 0's position is the number of tokens the request has emitted
before this step. For a sequence whose last step is still unread the host's count misses that step's tokens,
accepted + 1, which only the device knows: they are added there, from the unread verdict.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdec.models.pinned_upload import PinnedUpload

from .in_flight import InFlightStep, verdict_row
from .rejection_sampler import decide_on_device
from .sampling_batch import SamplingBatch
from .scheduler import ScheduledSeq


def launched_sample(logits: torch.Tensor, sampled: list[ScheduledSeq], drafts: torch.Tensor,
                    num_drafts: torch.Tensor, forced_accepts: torch.Tensor | None, previous: InFlightStep | None,
                    uploads: tuple[PinnedUpload, PinnedUpload]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S, K+1] padded with -1, accepted [S]) on the device. logits [R, V]: k_b + 1 rows per sampled
    entry; drafts [S, K], num_drafts [S] on the device; `uploads`: (floats, ints) copiers."""
    seqs = [p.seq for p in sampled]
    sampling = SamplingBatch.of(seqs, [False] * len(seqs), logits.shape[-1], uploads)
    unread = 0 if previous is None else len(previous.sampled)
    if unread:   # + the unread step's tokens: accepted + 1 for its sampled rows, 0 for the appended row
        rows = uploads[1](np.fromiter((verdict_row(p, previous, unread) for p in sampled), np.int64,
                                      count=len(sampled)))
        emitted = previous.accepted + 1 if previous.accepted is not None else rows.new_ones(unread)
        sampling = dataclasses.replace(sampling, offsets=sampling.offsets + torch.cat([emitted,
                                                                                       emitted.new_zeros(1)])[rows])
    tokens, accepted, *_ = decide_on_device(logits.float(), drafts, num_drafts, sampling, None, forced_accepts)
    return tokens, accepted
