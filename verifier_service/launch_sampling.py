"""The speculative rule of a launched (overlapped) step whose requests sample: what rejection_sample does for
requests without penalties or logprobs, with nothing read from the device.

Each sampled entry's rows are processed with its temperature / top-k / top-p / min-p, then the one-launch rule
(kernels.sampling.speculative_sample) decides them: the coupled draw for MTP's one-hot drafts, argmax on greedy
rows. The draws are keyed by (seed, output position); row 0's position is the number of tokens the request has
emitted before this step. For a sequence whose last step is still unread the host's count misses that step's
tokens, accepted + 1, which only the device knows: they are added there, from the unread verdict.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.sampling import speculative_sample
from specdec.models.pinned_upload import PinnedUpload

from .in_flight import InFlightStep, verdict_row
from .logits_processors import RowParams, processed_logits
from .scheduler import ScheduledSeq


def launched_sample(logits: torch.Tensor, sampled: list[ScheduledSeq], drafts: torch.Tensor,
                    num_drafts: torch.Tensor, cu_rows: torch.Tensor, forced_accepts: torch.Tensor | None,
                    previous: InFlightStep | None, uploads: tuple[PinnedUpload, PinnedUpload]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [S, K+1] padded with -1, accepted [S]) on the device. logits [R, V]: k_b + 1 rows per sampled
    entry; drafts [S, K], num_drafts [S], cu_rows [S+1] on the device; `uploads`: (floats, ints) copiers."""
    s, rows = len(sampled), logits.shape[0]
    params = [p.seq.params for p in sampled]
    counts = np.fromiter((p.num_drafts + 1 for p in sampled), np.int64, count=s)
    floats = np.array([[1.0 if q.greedy else q.temperature, q.top_p, q.min_p] for q in params],
                      np.float32).reshape(s, 3)
    unread = 0 if previous is None else len(previous.sampled)
    ints = np.concatenate([
        np.fromiter((q.greedy for q in params), np.int64, count=s),
        np.fromiter((q.top_k for q in params), np.int64, count=s),
        np.fromiter((p.seq.seed for p in sampled), np.int64, count=s),
        np.fromiter((len(p.seq.output_ids) for p in sampled), np.int64, count=s),     # tokens the host has
        np.fromiter((verdict_row(p, previous, unread) for p in sampled), np.int64, count=s),
        np.repeat(np.arange(s, dtype=np.int64), counts)])                               # [R] sequence of row
    f, i = uploads[0](floats), uploads[1](ints)
    greedy, top_k, seeds, offsets, unread_rows = (i[j * s:(j + 1) * s] for j in range(5))
    seq_of_row = i[5 * s:5 * s + rows]
    greedy = greedy.bool()
    if unread:   # + the unread step's tokens: accepted + 1 for its sampled rows, 0 for the appended row
        emitted = previous.accepted + 1 if previous.accepted is not None else offsets.new_ones(unread)
        offsets = offsets + torch.cat([emitted, emitted.new_zeros(1)])[unread_rows]
    row_params = RowParams(greedy=greedy[seq_of_row], temperature=f[:, 0][seq_of_row], top_k=top_k[seq_of_row],
                           top_p=f[:, 1][seq_of_row], min_p=f[:, 2][seq_of_row])
    truncates = any(q.top_k > 0 or q.top_p < 1.0 for q in params)
    processed = processed_logits(logits.float(), row_params, sort=truncates)                   # [R, V]
    tokens, accepted, _ = speculative_sample(processed, logits.argmax(-1), None, drafts, num_drafts, cu_rows,
                                             greedy, torch.zeros_like(greedy), seeds, offsets, forced_accepts)
    return tokens, accepted
