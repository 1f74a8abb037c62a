"""Ragged-batch helpers shared by the torch references (flat tokens + cu_seqlens)."""
import torch


def padded_token_index(cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [B, L] of each sequence's t-th token in the flat batch, valid [B, L]) with L = max_seqlen;
    invalid entries point at row 0 (callers mask them). No device value is read back to the host."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]                                                   # [B]
    steps = torch.arange(max_seqlen, device=cu.device)                        # [L]
    valid = steps[None, :] < lens[:, None]                                    # [B, L]
    return torch.where(valid, cu[:-1, None] + steps[None, :], 0), valid
