"""Triton causal depthwise conv1d + SiLU over a ragged batch with the speculative history window: same math
and signature as `reference.causal_conv1d_ref` (update of 1..k+1 tokens and prefill alike).

Two kernels, launched in turn. `_conv_out_kernel`: one program owns one (BC-wide channel block, BT-row tile of the
flat batch), whatever sequences its rows belong to (a row's sequence: how many sequences end at or before it), so a
prompt chunk's rows spread over the whole GPU. Output row t of a sequence starting at row bos needs xs[p .. p+W-1],
p = t - bos, where xs = [history | x]: tap j reads column s = p + j from the history
(conv_state[slot, c, read_offset + s], s < W-1) or from x (row t + j - (W-1)). Rows past the last sequence
(padding) load and store nothing. `_conv_window_kernel`, one program per (sequence, channel block), then stores
the new window xs[n-d .. n+W-2] at columns 0 .. W-2+d: it overwrites the history the output kernel read, so it
runs after it (stream order), and within the program its own reads come before its stores (a barrier).
Grids (cdiv(C, BC), cdiv(T, BT)) and (B, cdiv(C, BC)): static for a CUDA-graph bucket.
The state may be laid out either way (strides are arguments); the caches keep each column's channels contiguous
(`conv_state_columns`), so a step touches only the columns it reads and writes, not the whole window.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_seqs"])   # (a count that changes every step: one variant per BLOCK_SEQS)
def _conv_out_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, cu_seqlens_ptr, slots_ptr, read_offsets_ptr, num_seqs,
    stride_xt, stride_wc, stride_s_slot, stride_s_c, stride_s_w, stride_ot,
    C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, BLOCK_SEQS: tl.constexpr,
):
    i_c, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)                                                 # [BT] flat rows
    o_s = tl.arange(0, BLOCK_SEQS)
    ends = tl.load(cu_seqlens_ptr + 1 + o_s, mask=o_s < num_seqs, other=1 << 30)     # [BLOCK_SEQS] each sequence's end
    seq = tl.sum((ends[None, :] <= o_t[:, None]).to(tl.int32), axis=1)  # [BT] sequences ending at or before a row
    live = seq < num_seqs                                                             # padding rows: False
    seq = tl.minimum(seq, num_seqs - 1)
    pos = o_t - tl.load(cu_seqlens_ptr + seq)                                        # [BT] row in its sequence
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    read_offset = tl.load(read_offsets_ptr + seq).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m_tc = live[:, None] & m_c[None, :]
    p_state = state_ptr + slot[:, None] * stride_s_slot + o_c[None, :].to(tl.int64) * stride_s_c  # [BT, BC]
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        s = pos + j                                                                   # xs column
        in_history = (s < W - 1)[:, None]
        hist = tl.load(p_state + (read_offset + s)[:, None] * stride_s_w, mask=m_tc & in_history, other=0.0)
        xv = tl.load(x_ptr + (o_t + j - (W - 1)).to(tl.int64)[:, None] * stride_xt + o_c[None, :],
                     mask=m_tc & (~in_history), other=0.0)
        w_j = tl.load(w_ptr + o_c * stride_wc + j, mask=m_c, other=0.0).to(tl.float32)
        acc += (hist.to(tl.float32) + xv.to(tl.float32)) * w_j[None, :]
    y = acc / (1.0 + tl.exp(-acc))                                                    # silu
    tl.store(out_ptr + o_t.to(tl.int64)[:, None] * stride_ot + o_c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_tc)


@triton.jit
def _conv_window_kernel(
    x_ptr, state_ptr, cu_seqlens_ptr, slots_ptr, read_offsets_ptr, num_drafts_ptr,
    stride_xt, stride_s_slot, stride_s_c, stride_s_w,
    C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
):
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    n = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64) - bos
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    read_offset = tl.load(read_offsets_ptr + i_b).to(tl.int64)
    drafts = tl.load(num_drafts_ptr + i_b).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    p_state = state_ptr + slot * stride_s_slot + o_c[None, :].to(tl.int64) * stride_s_c      # [1, BC]
    o_w = tl.arange(0, BW)                                     # new window column
    s = n - drafts + o_w                                       # its xs column
    keep = (o_w < W - 1 + drafts)[:, None] & m_c[None, :]      # [BW, BC]
    in_history = (s < W - 1)[:, None]
    hist = tl.load(p_state + (read_offset + s)[:, None] * stride_s_w, mask=keep & in_history, other=0.0)
    xv = tl.load(x_ptr + (bos + s - (W - 1))[:, None] * stride_xt + o_c[None, :], mask=keep & (~in_history),
                 other=0.0)
    new = tl.where(in_history, hist.to(tl.float32), xv.to(tl.float32))
    tl.debug_barrier()                                         # every history read above happens before this
    tl.store(p_state + o_w[:, None] * stride_s_w, new.to(state_ptr.dtype.element_ty), mask=keep)


def causal_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
    slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor, max_seqlen: int,
    *, block_c: int = 64, num_warps: int = 4, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shapes as in `causal_conv1d_ref`; x may be a row-strided view (channels contiguous). `block_c`,
    `num_warps` are for the benchmark; `out` [T, C] lets a test pre-fill the output."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("causal_conv1d: x and weight must be contiguous in their last dim")
    stride_c, stride_w = conv_state.stride(1), conv_state.stride(2)
    if not ((stride_c == 1 and stride_w >= channels) or (stride_w == 1 and stride_c >= conv_state.shape[2])):
        raise ValueError(f"causal_conv1d: conv_state {tuple(conv_state.shape)} must keep a column's channels or a "
                         f"channel's columns contiguous, without overlap; strides {conv_state.stride()}")
    if conv_state.shape[2] < width - 1:
        raise ValueError(f"causal_conv1d: conv_state has {conv_state.shape[2]} columns, needs >= {width - 1}")
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    num_seqs = slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_t = max(2, min(32, triton.next_power_of_2(num_tokens)))
    block_c = min(block_c, triton.next_power_of_2(channels))
    num_c = triton.cdiv(channels, block_c)
    _conv_out_kernel[(num_c, triton.cdiv(num_tokens, block_t))](
        x, weight, conv_state, out, cu_seqlens, slots, read_offsets, num_seqs,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        C=channels, W=width, BC=block_c, BT=block_t, BLOCK_SEQS=triton.next_power_of_2(num_seqs), num_warps=num_warps)
    _conv_window_kernel[(num_seqs, num_c)](
        x, conv_state, cu_seqlens, slots, read_offsets, num_drafts,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        C=channels, W=width, BC=block_c, BW=triton.next_power_of_2(conv_state.shape[2]), num_warps=num_warps)
    return out
