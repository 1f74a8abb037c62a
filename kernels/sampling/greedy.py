"""The speculative rule when every row of a step is greedy, without penalties: what `speculative_sample_ref`
returns for such a batch, in a handful of tensor ops (no sampling state, no draws). The torch reference of the
all-greedy launch of the Triton sampler (speculative_triton.greedy_accept_triton, same signature).

    draft j of sequence b is accepted while argmax(row j) == draft j, for the leading run j < k_b
    emitted: the accepted drafts, then argmax at the first rejected row (or the bonus row)
    forced_accepts (benchmarks only) imposes min(forced, k_b) accepted drafts; the emitted token stays the target's
"""
from __future__ import annotations

import numpy as np
import torch


def cu_rows_of(num_drafts: np.ndarray) -> np.ndarray:
    """[B + 1] int64 on the host: sequence b's verify rows are cu[b] .. cu[b+1]-1 (its k_b drafts, then the bonus)."""
    return np.concatenate([[0], np.cumsum(num_drafts + 1)]).astype(np.int64)


def greedy_accept_ref(
    argmax: torch.Tensor,                        # [R] int64 argmax of each verify row's logits
    drafts: torch.Tensor,                        # [B, K] int64 proposals, padded with -1 beyond num_drafts
    num_drafts: torch.Tensor,                    # [B] int64 k_b <= K
    cu_rows: torch.Tensor,                       # [B + 1] int64 row offsets (cu_rows_of)
    forced_accepts: torch.Tensor | None = None,  # [B] int64 benchmarks only
) -> tuple[torch.Tensor, torch.Tensor]:          # tokens [B, K+1] padded with -1, num_accepted [B] int64
    width = drafts.shape[1] + 1
    cols = torch.arange(width, device=argmax.device)[None, :]                                # [1, K+1]
    rows = (cu_rows[:-1, None] + cols).clamp(max=argmax.shape[0] - 1)                        # [B, K+1]
    target = argmax[rows]                                                                   # past k_b: unused
    match = (target[:, :-1] == drafts) & (cols[:, :-1] < num_drafts[:, None])                 # [B, K]
    num_accepted = match.long().cumprod(-1).sum(-1)                                           # leading run
    if forced_accepts is not None:
        num_accepted = torch.minimum(forced_accepts.to(num_accepted), num_drafts)
    emitted = target.gather(1, num_accepted[:, None])                                         # [B, 1]
    padded = torch.nn.functional.pad(drafts, (0, 1), value=-1)
    tokens = torch.where(cols < num_accepted[:, None], padded, torch.where(cols == num_accepted[:, None], emitted, -1))
    return tokens, num_accepted
