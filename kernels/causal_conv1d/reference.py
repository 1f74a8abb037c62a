"""Pure-torch depthwise causal conv1d + SiLU over a ragged batch, with a speculative history window.

For a sequence with history h (the kernel-1 inputs before this step) and step inputs x_1..x_n:
    xs = [h | x_1 .. x_n]                       # [C, W-1+n]
    out_t = silu(sum_j w[:, j] * xs[:, t + j])  # t = 0..n-1, W = kernel width
Window (DESIGN §3.4): `conv_state[slot]` holds W-1+max_drafts columns. The step reads its history at
columns [read_offset, read_offset + W-1) and writes xs[:, n-d:] (W-1+d columns, d = drafts in this step)
at column 0, so that after j drafts are accepted the next history starts at column j.
"""
import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor,             # [T, C]
    weight: torch.Tensor,        # [C, W]
    conv_state: torch.Tensor,    # [num_slots, C, W - 1 + max_drafts], updated in place
    cu_seqlens: list[int],       # [B + 1] host ints
    slots: list[int],            # [B]
    read_offsets: list[int],     # [B]
    num_drafts: list[int],       # [B]
) -> torch.Tensor:               # [T, C]
    width = weight.shape[1]
    out = torch.empty_like(x)
    for b, slot in enumerate(slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        n, d, off = end - start, num_drafts[b], read_offsets[b]
        history = conv_state[slot, :, off:off + width - 1].to(x.dtype)     # [C, W-1]
        xs = torch.cat([history, x[start:end].t()], dim=1)                  # [C, W-1+n]
        y = F.conv1d(xs[None].float(), weight.float()[:, None, :], groups=xs.shape[0])[0]  # [C, n]
        out[start:end] = F.silu(y).t().to(x.dtype)
        keep = xs[:, n - d:]                                                # [C, W-1+d]
        conv_state[slot, :, :keep.shape[1]] = keep.to(conv_state.dtype)
    return out
