"""Pure-torch depthwise causal conv1d + SiLU over a ragged batch, with a speculative history window.

For a sequence with history h (the W-1 inputs before this step) and step inputs x_1..x_n:
    xs = [h | x_1 .. x_n]                       # [C, W-1+n]
    out_t = silu(sum_j w[:, j] * xs[:, t + j])  # t = 0..n-1, W = kernel width
Window (docs/architecture.md): `conv_state[slot]` holds W-1+max_drafts columns. The step reads its history at
columns [read_offset, read_offset + W-1) and writes xs[:, n-d:] (W-1+d columns, d = drafts in this step)
at column 0, so that after j drafts are accepted the next history starts at column j. Sequences of length 0
(padding in a CUDA-graph bucket) rewrite their history unchanged when read_offset is 0.
Vectorised over sequences (padded to max_seqlen); no device value is read back to the host.
"""
import torch
import torch.nn.functional as F

from kernels.ragged import padded_token_index


def causal_conv1d_ref(
    x: torch.Tensor,             # [T, C]
    weight: torch.Tensor,        # [C, W]
    conv_state: torch.Tensor,    # [num_slots, C, W - 1 + max_drafts], updated in place (any strides)
    cu_seqlens: torch.Tensor,    # [B + 1] int32
    slots: torch.Tensor,         # [B] int32
    read_offsets: torch.Tensor,  # [B] int32
    num_drafts: torch.Tensor,    # [B] int32
    max_seqlen: int,
) -> torch.Tensor:               # [T, C]
    num_tokens, channels = x.shape
    width, window = weight.shape[1], conv_state.shape[2]
    index, valid = padded_token_index(cu_seqlens, max_seqlen)                          # [B, L]
    slot, drafts = slots.long(), num_drafts.long()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()                                   # [B]
    history_cols = read_offsets.long()[:, None] + torch.arange(width - 1, device=x.device)
    history = conv_state[slot[:, None], :, history_cols].to(x.dtype)                   # [B, W-1, C]
    tokens = torch.where(valid[..., None], x[index], 0)                                # [B, L, C]
    xs = torch.cat([history, tokens], dim=1)                                           # [B, W-1+L, C]
    y = sum(xs[:, j:j + max_seqlen].float() * weight[:, j].float() for j in range(width))  # [B, L, C]
    out = torch.zeros(num_tokens + 1, channels, dtype=x.dtype, device=x.device)
    out[torch.where(valid, index, num_tokens)] = F.silu(y).to(x.dtype)
    cols = torch.arange(window, device=x.device)
    src = ((lens - drafts)[:, None] + cols).clamp(max=xs.shape[1] - 1)                 # [B, window] xs column
    keep = cols[None, :] < width - 1 + drafts[:, None]                                 # [B, window]
    new = xs.gather(1, src[..., None].expand(-1, -1, channels)).transpose(1, 2)        # [B, C, window]
    conv_state[slot] = torch.where(keep[:, None, :], new.to(conv_state.dtype), conv_state[slot])
    return out[:num_tokens]
