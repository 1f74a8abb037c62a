"""A draft-free step that is launched and not read yet: the engine launches step n + 1 before it reads step n's
tokens, so the host's work between two steps (reading tokens, stop checks, delivering outputs, scheduling,
staging the next batch) runs while the GPU computes instead of in front of it (DESIGN §5: "read one step late").

Step n's sampled tokens stay on the device; the sequences that sampled them run in step n + 1 with their last
token pending, and the engine writes those tokens into step n + 1's staged input ids on the device
(`pending_token_fill`). The host copy of step n's tokens is queued right behind their argmax, so reading them
waits for step n only, not for step n + 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.models.pinned_upload import PinnedUpload

from .scheduler import ScheduledSeq


@dataclass
class InFlightStep:
    sampled: list[ScheduledSeq]          # the plan's entries that sample a token, in logit-row order
    tokens: torch.Tensor | None          # [S] int64 on the device: each one's token (None: nothing sampled)
    host: torch.Tensor | None            # [S] int64, pinned on CUDA: the copy the host reads
    copied: torch.cuda.Event | None      # recorded after that copy (CUDA only)
    row_of: dict[int, int]               # seq_id -> its row in `tokens`

    @staticmethod
    def launch(sampled: list[ScheduledSeq], logits: torch.Tensor) -> "InFlightStep":
        """Queue the argmax of each sampled row (logits [S, V]) and its copy to the host; no sync."""
        row_of = {p.seq.seq_id: i for i, p in enumerate(sampled)}
        if not sampled:
            return InFlightStep(sampled, None, None, None, row_of)
        tokens = logits.argmax(-1)                                                    # [S]
        if tokens.device.type != "cuda":
            return InFlightStep(sampled, tokens, tokens, None, row_of)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tokens.device))
        return InFlightStep(sampled, tokens, host, copied, row_of)

    def read(self) -> list[int]:
        """The sampled tokens, in `sampled` order: the step's one host sync."""
        if self.host is None:
            return []
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def pending_token_fill(plan: list[ScheduledSeq], previous: InFlightStep | None,
                       upload: PinnedUpload) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat token indices [M], token ids [M]) on the device for the plan's pending tokens: each is the first
    token of its sequence's chunk, sampled by `previous`. None when no sequence has one."""
    starts, rows, at = [], [], 0
    for p in plan:
        if p.seq.pending:
            if previous is None or p.seq.seq_id not in previous.row_of:
                raise RuntimeError(f"sequence {p.seq.seq_id} has a pending token no launched step sampled")
            starts.append(at)
            rows.append(previous.row_of[p.seq.seq_id])
        at += len(p.chunk)
    if not starts:
        return None
    index = upload(np.array([starts, rows], np.int64))                             # [2, M]
    return index[0], previous.tokens[index[1]]
