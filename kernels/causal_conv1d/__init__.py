"""Causal depthwise conv1d + SiLU: public entry point, dispatched by device.

    causal_conv1d(x, weight, conv_state, cu_seqlens, slots, read_offsets, num_drafts, max_seqlen) -> [T, C]
    conv_state_columns(num_slots, channels, columns) -> a zeroed window in the layout the caches keep
CUDA tensors run the Triton kernel (`triton_conv.py`, imported on first CUDA use so tests can set
TRITON_INTERPRET=1 first), anything else the torch reference (`reference.py`).
"""
import torch

from .reference import causal_conv1d_ref


def causal_conv1d(x, weight, conv_state, cu_seqlens, slots, read_offsets, num_drafts,
                  max_seqlen: int) -> torch.Tensor:
    if x.is_cuda:
        from .triton_conv import causal_conv1d_triton
        return causal_conv1d_triton(x, weight, conv_state, cu_seqlens, slots, read_offsets, num_drafts, max_seqlen)
    return causal_conv1d_ref(x, weight, conv_state, cu_seqlens, slots, read_offsets, num_drafts, max_seqlen)


def conv_state_columns(num_slots: int, channels: int, columns: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed window [num_slots, channels, columns] stored column by column (a column's channels contiguous). A
    step reads W - 1 of its columns and writes W - 1 + d: stored channel by channel, the unused columns of every
    channel sit in the same memory sectors and move with them."""
    return torch.zeros(num_slots, columns, channels, dtype=dtype, device=device).transpose(1, 2)


__all__ = ["causal_conv1d", "causal_conv1d_ref", "conv_state_columns"]
