"""Triton causal depthwise conv1d + SiLU over a ragged batch with the speculative history window: same math
and signature as `reference.causal_conv1d_ref` (update of 1..k+1 tokens and prefill alike).

One program owns one (sequence, BC-wide channel block). It walks the sequence in tiles of BT tokens; output
token t needs xs[t .. t+W-1] where xs = [history | x], so each tap j reads column s = t + j from the history
(conv_state[slot, c, read_offset + s], s < W-1) or from x (row bos + s - (W-1)). After all reads (a barrier:
the window it writes overlaps the history it read), it stores the new window xs[n-d .. n+W-2] at columns
0 .. W-2+d. Channel blocks are disjoint, so programs never share a state element.
Grid (B, cdiv(C, BC)): static for a CUDA-graph bucket; the token loop bound is read on the device.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, state_ptr, out_ptr, cu_seqlens_ptr, slots_ptr, read_offsets_ptr, num_drafts_ptr,
    stride_xt, stride_wc, stride_s_slot, stride_s_c, stride_ot,
    C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
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
    for t0 in range(0, n, BT):
        o_t = t0 + tl.arange(0, BT)                                                           # [BT]
        m_tc = (o_t < n)[:, None] & m_c[None, :]
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            s = o_t + j                                                                       # xs column
            in_history = (s < W - 1)[:, None]
            hist = tl.load(p_state + (read_offset + s)[:, None], mask=m_tc & in_history, other=0.0)
            xv = tl.load(x_ptr + (bos + s - (W - 1))[:, None] * stride_xt + o_c[None, :],
                         mask=m_tc & (~in_history), other=0.0)
            w_j = tl.load(w_ptr + o_c * stride_wc + j, mask=m_c, other=0.0).to(tl.float32)
            acc += (hist.to(tl.float32) + xv.to(tl.float32)) * w_j[None, :]
        y = acc / (1.0 + tl.exp(-acc))                                                      # silu
        tl.store(out_ptr + (bos + o_t)[:, None] * stride_ot + o_c[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=m_tc)

    o_w = tl.arange(0, BW)                                     # new window column
    s = n - drafts + o_w                                       # its xs column
    keep = (o_w < W - 1 + drafts)[:, None] & m_c[None, :]      # [BW, BC]
    in_history = (s < W - 1)[:, None]
    hist = tl.load(p_state + (read_offset + s)[:, None], mask=keep & in_history, other=0.0)
    xv = tl.load(x_ptr + (bos + s - (W - 1))[:, None] * stride_xt + o_c[None, :], mask=keep & (~in_history),
                 other=0.0)
    new = tl.where(in_history, hist.to(tl.float32), xv.to(tl.float32))
    tl.debug_barrier()                                         # every history read above happens before this
    tl.store(p_state + o_w[:, None], new.to(state_ptr.dtype.element_ty), mask=keep)


def causal_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
    slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor, max_seqlen: int,
    *, block_c: int = 64, num_warps: int = 4, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shapes as in `causal_conv1d_ref`; x may be a row-strided view (channels contiguous). `block_c`,
    `num_warps` are for the benchmark; `out` [T, C] lets a test pre-fill the output."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if x.stride(1) != 1 or weight.stride(1) != 1 or conv_state.stride(2) != 1:
        raise ValueError("causal_conv1d: x, weight and conv_state must be contiguous in their last dim")
    if conv_state.shape[2] < width - 1:
        raise ValueError(f"causal_conv1d: conv_state has {conv_state.shape[2]} columns, needs >= {width - 1}")
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    block_t = max(2, min(16, triton.next_power_of_2(max(max_seqlen, 1))))
    block_c = min(block_c, triton.next_power_of_2(channels))
    grid = (slots.shape[0], triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, conv_state, out, cu_seqlens, slots, read_offsets, num_drafts,
        x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        C=channels, W=width, BC=block_c, BT=block_t, BW=triton.next_power_of_2(conv_state.shape[2]),
        num_warps=num_warps,
    )
    return out
