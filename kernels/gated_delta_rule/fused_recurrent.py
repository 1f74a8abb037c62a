"""Triton fused recurrent gated delta rule for decode / verify (1..k+1 tokens per sequence) and the prefill
fallback: same math and signature as `reference.gated_delta_rule_ref` (the deferred-commit layout is described
there).

One program owns one (sequence, value head, BV-wide slice of V). It loads its [K, BV] slice of state[slot], then
walks the sequence's virtual tokens: first the `read_offset` drafts of the last step that were accepted (their
raw inputs read back from the pending ring), then this step's tokens. It stores the state after the step's
last non-draft token into state[slot] (only that program reads and writes its slice, so in place is safe) and
the raw inputs of the step's drafts into the ring at their positions mod R. The entries a step writes and the
ones it replays never alias (n + j - 1 < R for a step of n = 1 + d tokens replaying j <= R / 2 - 1), so programs
of one sequence that still replay never read what another has just written.
The token loop is software-pipelined: token u + 1's inputs are loaded while token u updates the state and are
normalised after it, so each token's dependent chain is one pass of reductions over the state slice.
Grid (cdiv(V, BV), B * HV): static for a CUDA-graph bucket; sequences of length 0 replay nothing, run no token.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, u, j, bos, eos, first_saved, pos0, i_v, i_hk, i_hv,
                o_k, o_v, m_k, m_v, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at,
                stride_bt, stride_pe, R: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                HK: tl.constexpr, HV: tl.constexpr):
    """Virtual token u's raw inputs (q [BK], k [BK], v [BV], a, b) in fp32: u < j replays ring entry
    (pos0 - j + u) mod R (q is zero: a replayed token has no output), u >= j is token t = bos + u - j; zeros
    past the end. A draft token's raw k, v, a, b go to ring entry (pos0 + t - bos) mod R on the way."""
    t = bos + u - j
    rk, rv = o_k * 0 + u, o_v * 0 + u                          # vectors: the interpreter cannot AND scalar masks
    real_k, real_v = m_k & (rk >= j) & (rk - j + bos < eos), m_v & (rv >= j) & (rv - j + bos < eos)
    rep_k, rep_v = m_k & (rk < j), m_v & (rv < j)
    real, rep = (u >= j) & (t < eos), u < j
    p_e = p_pend + (tl.maximum(pos0 - j + u, 0) % R) * stride_pe
    off_v, off_a = HK * K, HK * K + HV * V
    b_q = tl.load(q_ptr + t * stride_qt + i_hk * stride_qh + o_k, mask=real_k, other=0.0).to(tl.float32)
    b_k = (tl.load(k_ptr + t * stride_kt + i_hk * stride_kh + o_k, mask=real_k, other=0.0).to(tl.float32)
           + tl.load(p_e + i_hk * K + o_k, mask=rep_k, other=0.0).to(tl.float32))
    b_v = (tl.load(v_ptr + t * stride_vt + i_hv * stride_vh + o_v, mask=real_v, other=0.0).to(tl.float32)
           + tl.load(p_e + off_v + i_hv * V + o_v, mask=rep_v, other=0.0).to(tl.float32))
    x = (tl.load(a_ptr + t * stride_at + i_hv, mask=real, other=0.0).to(tl.float32)
         + tl.load(p_e + off_a + i_hv, mask=rep, other=0.0).to(tl.float32))
    y = (tl.load(b_ptr + t * stride_bt + i_hv, mask=real, other=0.0).to(tl.float32)
         + tl.load(p_e + off_a + HV + i_hv, mask=rep, other=0.0).to(tl.float32))
    # a draft (t > first_saved): stash; k once per key head, a and b once per value head
    p_w = p_pend + (tl.maximum(pos0 + t - bos, 0) % R) * stride_pe
    draft_k, draft_v = real_k & (rk - j + bos > first_saved), real_v & (rv - j + bos > first_saved)
    first_k = (o_k * 0 + i_v == 0) & (o_k * 0 + i_hv % GROUP == 0)
    tl.store(p_w + i_hk * K + o_k, b_k.to(p_pend.dtype.element_ty), mask=draft_k & first_k)
    tl.store(p_w + off_v + i_hv * V + o_v, b_v.to(p_pend.dtype.element_ty), mask=draft_v)
    draft = real & (t > first_saved) & (i_v == 0)
    tl.store(p_w + off_a + i_hv, x.to(p_pend.dtype.element_ty), mask=draft)
    tl.store(p_w + off_a + HV + i_hv, y.to(p_pend.dtype.element_ty), mask=draft)
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
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, pending_ptr, out_ptr,
    cu_seqlens_ptr, slots_ptr, read_offsets_ptr, num_drafts_ptr, positions_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_s_slot, stride_s_head, stride_s_k, stride_p_slot, stride_pe,
    stride_ot, stride_oh,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PIPELINE: tl.constexpr, REPLAY_ONLY: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // GROUP
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    live = bos < eos
    j = tl.where(live, tl.load(read_offsets_ptr + i_b).to(tl.int64), 0)            # last step's drafts to replay
    pos0 = tl.load(positions_ptr + bos, mask=live, other=0).to(tl.int64)            # position of token bos
    first_saved = eos - 1 - tl.load(num_drafts_ptr + i_b).to(tl.int64)   # last non-draft token: its state is kept
    end = j if REPLAY_ONLY else j + eos - bos                                       # virtual tokens

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_h = (state_ptr + slot * stride_s_slot + i_hv * stride_s_head
           + o_k[:, None].to(tl.int64) * stride_s_k + o_v[None, :])                # [BK, BV] slice of state[slot]
    b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    p_pend = pending_ptr + slot * stride_p_slot

    neg_A = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    if PIPELINE:
        b_q, b_k, b_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, 0, j, bos, eos, first_saved,
                                          pos0, i_v, i_hk, i_hv, o_k, o_v, m_k, m_v, stride_qt, stride_qh,
                                          stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
                                          stride_pe, R, GROUP, K, V, HK, HV)
        b_q, b_k, decay, beta, qk = _prepare_token(b_q, b_k, x, y, neg_A, dt_bias, scale)
    for u in range(0, end):
        if PIPELINE:   # token u + 1's inputs in flight while token u updates the state
            n_q, n_k, n_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, u + 1, j, bos, eos,
                                              first_saved, pos0, i_v, i_hk, i_hv, o_k, o_v, m_k, m_v, stride_qt,
                                              stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at,
                                              stride_bt, stride_pe, R, GROUP, K, V, HK, HV)
        else:
            b_q, b_k, b_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, u, j, bos, eos,
                                              first_saved, pos0, i_v, i_hk, i_hv, o_k, o_v, m_k, m_v, stride_qt,
                                              stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at,
                                              stride_bt, stride_pe, R, GROUP, K, V, HK, HV)
            b_q, b_k, decay, beta, qk = _prepare_token(b_q, b_k, x, y, neg_A, dt_bias, scale)
        # Both reductions read the old S, side by side (one dependent reduction per token, not two):
        #   S' = decay * S + k delta^T,   delta = beta * (v - decay * S^T k),   o = S'^T q = decay * S^T q + (q.k) delta
        s_k = tl.sum(b_h * b_k[:, None], axis=0)                                   # [BV]
        s_q = tl.sum(b_h * b_q[:, None], axis=0)                                   # [BV]
        delta = beta * (b_v - decay * s_k)                                         # [BV]
        b_o = decay * s_q + qk * delta                                             # [BV]
        b_h = b_h * decay + b_k[:, None] * delta[None, :]
        t = bos + u - j
        vt = o_v * 0 + u                                                           # [BV] (see _load_token)
        tl.store(out_ptr + t * stride_ot + i_hv * stride_oh + o_v, b_o.to(out_ptr.dtype.element_ty),
                 mask=m_v & (vt >= j))
        tl.store(p_h, b_h, mask=m_h & (vt - j + bos == first_saved)[None, :])      # the committed state
        if PIPELINE:
            b_v = n_v
            b_q, b_k, decay, beta, qk = _prepare_token(n_q, n_k, x, y, neg_A, dt_bias, scale)
    if REPLAY_ONLY:
        tl.store(p_h, b_h, mask=m_h & (o_v * 0 + bos < eos)[None, :])


def launch_config(num_seqs: int, max_tokens: int) -> tuple[int, int, bool]:
    """(BV, warps, pipelined token loop) for `num_seqs` sequences of at most `max_tokens` virtual tokens (replayed
    drafts + the step's tokens). Measured on an H100 at the 4B shape (bench/results/h100_2026-11-25/gdn/deferred/
    kernels.log): one warp per 16-wide value slice at every batch (verify with 3 replayed, b64: 0.181 ms against
    0.264 at BV 32 / 2 warps), pipelined except for single tokens up to 16 sequences (decode b1: 0.0030 ms
    against 0.0035; b64: 0.104 against 0.111 unpipelined)."""
    return 16, 1, max_tokens > 1 or num_seqs > 16


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, pending: torch.Tensor,
    cu_seqlens: torch.Tensor, slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor,
    positions: torch.Tensor, max_seqlen: int,
    *, replay_only: bool = False, block_v: int | None = None, num_warps: int | None = None,
    pipeline: bool | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shapes as in `gated_delta_rule_ref`; q/k/v/a/b may be row-strided views (last dim contiguous).
    `replay_only`: only fold the replayed drafts into state[slot] (before a kernel that starts from state[slot],
    fla-core's chunk prefill); no token runs, the output is left as it is. `block_v`, `num_warps`, `pipeline` are for
    the benchmark and tests (None: `launch_config`'s choice); `out` [T, HV, V] lets a test pre-fill the output."""
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
        if x.stride(-1) != 1:
            raise ValueError(f"gated_delta_rule: {name} must be contiguous in its last dim, strides {x.stride()}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"gated_delta_rule: state must be contiguous fp32, got {state.dtype}")
    if not pending.is_contiguous() or pending.shape[2] != num_k_heads * head_k + num_v_heads * (head_v + 2):
        raise ValueError(f"gated_delta_rule: pending must be contiguous [slots, R, HK*K + HV*V + 2*HV], "
                         f"got {tuple(pending.shape)}")
    if out is None:
        out = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    num_seqs, ring = slots.shape[0], pending.shape[1]
    chosen = launch_config(num_seqs, max_seqlen + ring // 2 - 1)
    block_v = min(chosen[0] if block_v is None else block_v, triton.next_power_of_2(head_v))
    num_warps = chosen[1] if num_warps is None else num_warps
    pipeline = chosen[2] if pipeline is None else pipeline
    grid = (triton.cdiv(head_v, block_v), num_seqs * num_v_heads)
    _gdn_recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, pending, out, cu_seqlens, slots, read_offsets, num_drafts, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), pending.stride(0), pending.stride(1),
        out.stride(0), out.stride(1),
        head_k ** -0.5,
        HK=num_k_heads, HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=head_k, V=head_v, R=ring,
        BK=triton.next_power_of_2(head_k), BV=block_v, PIPELINE=pipeline, REPLAY_ONLY=replay_only,
        num_warps=num_warps,
    )
    return out
