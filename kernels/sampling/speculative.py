"""The speculative rule's device dispatch: the one-launch Triton kernel on CUDA, the torch references elsewhere."""
from __future__ import annotations

import torch

from .greedy import greedy_accept_ref
from .reference import speculative_sample_ref

try:
    from .speculative_triton import greedy_accept_triton, speculative_sample_triton
except ImportError:  # no Triton on this platform: the references serve every device
    greedy_accept_triton = speculative_sample_triton = None


def speculative_sample(logits: torch.Tensor | None, greedy_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       drafts: torch.Tensor, num_drafts: torch.Tensor, cu_rows: torch.Tensor, greedy: torch.Tensor,
                       uses_q: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                       forced_accepts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculative_sample_ref's contract (tokens [B, K+1] padded with -1, num_accepted [B], row_tokens [R])."""
    if greedy_tokens.is_cuda and speculative_sample_triton is not None:
        return speculative_sample_triton(logits, greedy_tokens, draft_probs, drafts, num_drafts, cu_rows, greedy,
                                         uses_q, seeds, offsets, forced_accepts)
    return speculative_sample_ref(logits, greedy_tokens, draft_probs, drafts, num_drafts, cu_rows, greedy, uses_q,
                                  seeds, offsets, forced_accepts)


def greedy_accept(argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, cu_rows: torch.Tensor,
                  forced_accepts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_accept_ref's contract (tokens [B, K+1] padded with -1, num_accepted [B])."""
    if argmax.is_cuda and greedy_accept_triton is not None:
        return greedy_accept_triton(argmax, drafts, num_drafts, cu_rows, forced_accepts)
    return greedy_accept_ref(argmax, drafts, num_drafts, cu_rows, forced_accepts)
