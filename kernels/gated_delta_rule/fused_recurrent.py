"""Triton fused recurrent gated delta rule for decode / verify (1..k+1 tokens per sequence) and the prefill
fallback: same math and signature as `reference.gated_delta_rule_ref`.

One program owns one (sequence, value head, BV-wide slice of V): it loads its [K, BV] slice of the state
from state[slot, read_offset] (chosen on the device), walks the sequence's tokens computing gating, l2norm and
the q scale in registers, and stores the state after each trailing draft token into state[slot, i]. Slices
are disjoint across programs, and each program reads its whole initial slice before writing any, so reading
slot `read_offset` while writing slots 0..d of the same group is safe.
The token loop is software-pipelined: token t + 1's inputs are loaded while token t updates the state and are
normalised after it, so each token's dependent chain is one pass of reductions over the state slice.
Grid (cdiv(V, BV), B * HV): static for a CUDA-graph bucket; sequences of length 0 run an empty loop.
"""
import torch
import triton
import triton.language as tl

SAVE_ALL = 1     # write the state after each of the trailing 1 + d tokens (the slot-writing design)
SAVE_NONE = 0    # write no state (the recompute-at-commit design: bench/gdn_state_traffic.md)


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t, valid, i_hk, i_hv, o_k, o_v, m_k, m_v,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt):
    """Token t's raw inputs (q [BK], k [BK], v [BV], a, b); zeros from t = `valid` (the sequence's end) on."""
    vk, vv = m_k & ((o_k * 0 + t) < valid), m_v & ((o_v * 0 + t) < valid)   # vectors: see the SAVE store
    b_q = tl.load(q_ptr + t * stride_qt + i_hk * stride_qh + o_k, mask=vk, other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + t * stride_kt + i_hk * stride_kh + o_k, mask=vk, other=0.0).to(tl.float32)
    b_v = tl.load(v_ptr + t * stride_vt + i_hv * stride_vh + o_v, mask=vv, other=0.0).to(tl.float32)
    x = tl.load(a_ptr + t * stride_at + i_hv, mask=t < valid, other=0.0).to(tl.float32)
    y = tl.load(b_ptr + t * stride_bt + i_hv, mask=t < valid, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, x, y


@triton.jit
def _prepare_token(b_q, b_k, x, y, neg_A, dt_bias, scale):
    """Everything of a token that does not touch the state: l2-normed q (scaled) and k, the decay exp(g),
    beta, and q.k (for the output identity below)."""
    x = x + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))   # = F.softplus
    decay = tl.exp(neg_A * softplus)
    beta = 1.0 / (1.0 + tl.exp(-y))
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    return b_q, b_k, decay, beta, tl.sum(b_q * b_k)


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, out_ptr,
    cu_seqlens_ptr, slots_ptr, read_offsets_ptr, num_drafts_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_s_slot, stride_s_draft, stride_s_head, stride_s_k,
    stride_ot, stride_oh,
    scale,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr, PIPELINE: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // GROUP
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    read_offset = tl.load(read_offsets_ptr + i_b).to(tl.int64)
    first_saved = eos - 1 - tl.load(num_drafts_ptr + i_b).to(tl.int64)   # token whose state goes to slot 0

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_group = state_ptr + slot * stride_s_slot + i_hv * stride_s_head
    p_h = p_group + o_k[:, None].to(tl.int64) * stride_s_k + o_v[None, :]       # [BK, BV] within one state
    b_h = tl.load(p_h + read_offset * stride_s_draft, mask=m_h, other=0.0).to(tl.float32)

    neg_A = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    if PIPELINE:
        b_q, b_k, b_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bos, eos, i_hk, i_hv, o_k, o_v,
                                          m_k, m_v, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                          stride_vh, stride_at, stride_bt)
        b_q, b_k, decay, beta, qk = _prepare_token(b_q, b_k, x, y, neg_A, dt_bias, scale)
    for t in range(bos, eos):
        if PIPELINE:   # token t + 1's inputs in flight while token t updates the state
            n_q, n_k, n_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t + 1, eos, i_hk, i_hv, o_k, o_v,
                                              m_k, m_v, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                              stride_vh, stride_at, stride_bt)
        else:
            b_q, b_k, b_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, t, eos, i_hk, i_hv, o_k, o_v,
                                              m_k, m_v, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                              stride_vh, stride_at, stride_bt)
            b_q, b_k, decay, beta, qk = _prepare_token(b_q, b_k, x, y, neg_A, dt_bias, scale)
        # Both reductions read the old S, side by side (one dependent reduction per token, not two):
        #   S' = decay * S + k delta^T,   delta = beta * (v - decay * S^T k),   o = S'^T q = decay * S^T q + (q.k) delta
        s_k = tl.sum(b_h * b_k[:, None], axis=0)                                   # [BV]
        s_q = tl.sum(b_h * b_q[:, None], axis=0)                                   # [BV]
        delta = beta * (b_v - decay * s_k)                                         # [BV]
        b_o = decay * s_q + qk * delta                                             # [BV]
        b_h = b_h * decay + b_k[:, None] * delta[None, :]
        tl.store(out_ptr + t * stride_ot + i_hv * stride_oh + o_v, b_o.to(out_ptr.dtype.element_ty), mask=m_v)
        if SAVE == 1:
            keep = (o_v * 0 + t) >= first_saved      # [BV]: a vector, the interpreter cannot AND a scalar mask
            tl.store(p_h + (t - first_saved) * stride_s_draft, b_h, mask=m_h & keep[None, :])
        if PIPELINE:
            b_v = n_v
            b_q, b_k, decay, beta, qk = _prepare_token(n_q, n_k, x, y, neg_A, dt_bias, scale)


def launch_config(num_seqs: int, max_seqlen: int) -> tuple[int, int, bool]:
    """(BV, warps, pipelined token loop) for a step of `num_seqs` sequences of at most `max_seqlen` tokens.
    Measured on an H100 at the 4B shape (bench/results/h100_2026-11-25/gdn/): up to 16 sequences, one warp per
    16-wide value slice (more programs, reductions inside a warp); beyond, 32-wide slices on 2 warps. The
    pipelined loop pays off while latency bounds the kernel (up to 4 sequences of several tokens: verify b1
    0.0058 ms against 0.0066 unpipelined); from b8 it costs occupancy (verify b8 0.0364 against 0.0329)."""
    if num_seqs > 16:
        return 32, 2, False
    return 16, 1, max_seqlen > 1 and num_seqs <= 4


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
    slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor, max_seqlen: int,
    *, save: int = SAVE_ALL, block_v: int | None = None, num_warps: int | None = None,
    pipeline: bool | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shapes as in `gated_delta_rule_ref`; q/k/v/a/b may be row-strided views (last dim contiguous).
    `save`, `block_v`, `num_warps`, `pipeline` are for the benchmark and tests (None: `launch_config`'s
    measured choice); `out` [T, HV, V] lets a test pre-fill the output."""
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        if x.stride(-1) != 1:
            raise ValueError(f"gated_delta_rule: {name} must be contiguous in its last dim, strides {x.stride()}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"gated_delta_rule: state must be contiguous fp32, got {state.dtype}")
    if out is None:
        out = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    num_seqs = slots.shape[0]
    chosen = launch_config(num_seqs, max_seqlen)
    block_v = min(chosen[0] if block_v is None else block_v, triton.next_power_of_2(head_v))
    num_warps = chosen[1] if num_warps is None else num_warps
    pipeline = chosen[2] if pipeline is None else pipeline
    grid = (triton.cdiv(head_v, block_v), num_seqs * num_v_heads)
    _gdn_recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, out, cu_seqlens, slots, read_offsets, num_drafts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        out.stride(0), out.stride(1),
        head_k ** -0.5,
        HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=head_k, V=head_v,
        BK=triton.next_power_of_2(head_k), BV=block_v, SAVE=save, PIPELINE=pipeline, num_warps=num_warps,
    )
    return out
