"""The speculative rule when every row of a step is greedy, without penalties: what `speculative_sample_ref`
returns for such a batch, in a handful of tensor ops (no row layout, no sampling state, no draws).

    draft j of sequence b is accepted while argmax(row j) == draft j, for the leading run j < k_b
    emitted: the accepted drafts, then argmax at the first rejected row (or the bonus row)
    forced_accepts (benchmarks only) imposes min(forced, k_b) accepted drafts; the emitted token stays the target's
"""
from __future__ import annotations

import numpy as np
import torch


def row_index(num_drafts: np.ndarray) -> np.ndarray:
    """[B, K+1] int64 on the host: the verify row of sequence b's j-th position (k_b + 1 rows each, packed in
    order), -1 beyond its bonus row. K = max k_b."""
    width = int(num_drafts.max(initial=0)) + 1
    starts = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]]).astype(np.int64)          # [B]
    cols = np.arange(width, dtype=np.int64)[None, :]
    return np.where(cols <= num_drafts[:, None], starts[:, None] + cols, -1)


def greedy_accept(
    argmax: torch.Tensor,                        # [R] int64 argmax of each verify row's logits
    rows: torch.Tensor,                          # [B, K+1] int64 from row_index
    drafts: torch.Tensor,                        # [B, K] int64 proposals, padded with -1 beyond num_drafts
    forced_accepts: torch.Tensor | None = None,  # [B] int64 benchmarks only
) -> tuple[torch.Tensor, torch.Tensor]:          # tokens [B, K+1] padded with -1, num_accepted [B] int64
    width = rows.shape[1]
    target = argmax[rows.clamp(min=0)]                                                      # [B, K+1]
    match = (target[:, :-1] == drafts) & (drafts >= 0)                                        # [B, K]
    num_accepted = match.long().cumprod(-1).sum(-1)                                           # leading run
    if forced_accepts is not None:
        num_accepted = torch.minimum(forced_accepts.to(num_accepted), (rows >= 0).sum(-1) - 1)
    cols = torch.arange(width, device=rows.device)[None, :]
    emitted = target.gather(1, num_accepted[:, None])                                         # [B, 1]
    padded = torch.nn.functional.pad(drafts, (0, 1), value=-1)
    tokens = torch.where(cols < num_accepted[:, None], padded, torch.where(cols == num_accepted[:, None], emitted, -1))
    return tokens, num_accepted
