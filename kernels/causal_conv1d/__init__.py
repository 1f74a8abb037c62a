"""Causal depthwise conv1d + SiLU: public entry point, dispatched by device.

    causal_conv1d(x, weight, conv_state, cu_seqlens, slots, read_offsets, num_drafts, max_seqlen) -> [T, C]
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


__all__ = ["causal_conv1d", "causal_conv1d_ref"]
