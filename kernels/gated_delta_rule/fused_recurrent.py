"""Triton fused recurrent gated delta rule for decode / verify (1..k+1 tokens per sequence) and the prefill
fallback: same math and signature as `reference.gated_delta_rule_ref` (the deferred-commit layout is described
there).

One program owns one (sequence, value head, BV-wide slice of V). It loads its [K, BV] slice of state[slot] and
runs two loops: first it replays the `read_offset` drafts of the last step that were accepted (their raw k, v,
a, b read back from the pending ring: a state update, no query, no output), then this step's tokens. It stores
the state after the step's last non-draft token into state[slot] (only that program reads and writes its slice,
so in place is safe) and the raw inputs of the step's drafts into the ring at their positions mod R. The
entries a step writes and the ones it replays never alias (n + j - 1 < R for a step of n = 1 + d tokens
replaying j <= R / 2 - 1), so programs of one sequence never read what another has just written.
Both loops are software-pipelined: token u + 1's inputs are loaded while token u updates the state and are
normalised after it, so each token's dependent chain is one pass of reductions over the state slice; the first
token's inputs are loaded before the replay starts.
Grid (cdiv(V, BV), B * HV): static for a CUDA-graph bucket; sequences of length 0 replay nothing, run no token.
`skip` (a step's chunk lanes, specdec/models/forward_batch.py): sequences whose index is in its first column are
left alone, as if of length 0: the chunked kernel runs them.
"""
import torch
import triton
import triton.language as tl

from . import launch_config


@triton.jit
def _gates(x, y, neg_A, dt_bias):
    """(decay exp(g), beta) of a token from its raw a (x) and b (y)."""
    x = x + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))   # = F.softplus
    return tl.exp(neg_A * softplus), 1.0 / (1.0 + tl.exp(-y))


@triton.jit
def _l2normed(x):
    return x * tl.rsqrt(tl.sum(x * x) + 1e-6)


@triton.jit
def _load_replayed(p_pend, e, stride_pe, i_hk, i_hv, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr,
                   HK: tl.constexpr, HV: tl.constexpr):
    """Ring entry e's raw k [BK], v [BV], a, b in fp32 (an accepted draft of the last step, committed now)."""
    p_e = p_pend + e * stride_pe
    b_k = tl.load(p_e + i_hk * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(p_e + HK * K + i_hv * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    x = tl.load(p_e + HK * K + HV * V + i_hv).to(tl.float32)
    y = tl.load(p_e + HK * K + HV * V + HV + i_hv).to(tl.float32)
    return b_k, b_v, x, y


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, t, eos, first_saved, pos0, bos, i_v, i_hk, i_hv,
                o_k, o_v, m_k, m_v, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at,
                stride_bt, stride_pe, R: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                HK: tl.constexpr, HV: tl.constexpr):
    """Token t's raw q [BK], k [BK], v [BV], a, b in fp32, zeros at t >= eos (the look-ahead past the end). A
    draft (first_saved < t < eos) also goes to ring entry (its position) mod R, k once per key head, a and b
    once per value head."""
    in_k, in_v = m_k & (o_k * 0 + t < eos), m_v & (o_v * 0 + t < eos)   # vectors: the interpreter cannot AND scalars
    b_q = tl.load(q_ptr + t * stride_qt + i_hk * stride_qh + o_k, mask=in_k, other=0.0)
    b_k = tl.load(k_ptr + t * stride_kt + i_hk * stride_kh + o_k, mask=in_k, other=0.0)
    b_v = tl.load(v_ptr + t * stride_vt + i_hv * stride_vh + o_v, mask=in_v, other=0.0)
    x = tl.load(a_ptr + t * stride_at + i_hv, mask=t < eos, other=0.0)
    y = tl.load(b_ptr + t * stride_bt + i_hv, mask=t < eos, other=0.0)
    if (t > first_saved) & (t < eos):
        p_w = p_pend + ((pos0 + t - bos) % R) * stride_pe
        if (i_v == 0) & (i_hv % GROUP == 0):
            tl.store(p_w + i_hk * K + o_k, b_k.to(p_pend.dtype.element_ty), mask=m_k)
        tl.store(p_w + HK * K + i_hv * V + o_v, b_v.to(p_pend.dtype.element_ty), mask=m_v)
        if i_v == 0:
            tl.store(p_w + HK * K + HV * V + i_hv, x.to(p_pend.dtype.element_ty))
            tl.store(p_w + HK * K + HV * V + HV + i_hv, y.to(p_pend.dtype.element_ty))
    return b_q.to(tl.float32), b_k.to(tl.float32), b_v.to(tl.float32), x.to(tl.float32), y.to(tl.float32)


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, pending_ptr, out_ptr,
    cu_seqlens_ptr, slots_ptr, read_offsets_ptr, num_drafts_ptr, positions_ptr, skip_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_s_slot, stride_s_head, stride_s_k, stride_p_slot, stride_pe,
    stride_ot, stride_oh,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PIPELINE: tl.constexpr, REPLAY_ONLY: tl.constexpr, NUM_SKIP: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // GROUP
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_b + 1).to(tl.int64)
    for n in tl.static_range(NUM_SKIP):                                            # [NUM_SKIP, 4] rows, column 0
        eos = tl.where(tl.load(skip_ptr + 4 * n) == i_b, bos, eos)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    live = bos < eos
    j = tl.where(live, tl.load(read_offsets_ptr + i_b).to(tl.int64), 0)            # last step's drafts to replay
    pos0 = tl.load(positions_ptr + bos, mask=live, other=0).to(tl.int64)            # position of token bos
    first_saved = eos - 1 - tl.load(num_drafts_ptr + i_b).to(tl.int64)   # last non-draft token: its state is kept
    stop = bos if REPLAY_ONLY else eos

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_h = (state_ptr + slot * stride_s_slot + i_hv * stride_s_head
           + o_k[:, None].to(tl.int64) * stride_s_k + o_v[None, :])                # [BK, BV] slice of state[slot]
    b_h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    p_pend = pending_ptr + slot * stride_p_slot
    first_replayed = tl.maximum(pos0 - j, 0)   # ring entry of the first replay: mod R (a valid step has pos0 >= j)

    neg_A = -tl.exp(tl.load(A_log_ptr + i_hv).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + i_hv).to(tl.float32)
    if PIPELINE:   # the step's first token and first replayed draft: neither depends on the state
        n_q, n_k, n_v, nx, ny = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, bos, stop, first_saved, pos0,
                                            bos, i_v, i_hk, i_hv, o_k, o_v, m_k, m_v, stride_qt, stride_qh,
                                            stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
                                            stride_pe, R, GROUP, K, V, HK, HV)
        r_k, r_v, x, y = _load_replayed(p_pend, first_replayed % R, stride_pe, i_hk, i_hv, o_k, o_v, m_k, m_v,
                                        K, V, HK, HV)
        r_k = _l2normed(r_k)
        decay, beta = _gates(x, y, neg_A, dt_bias)
    # Replay: S <- decay * S + k delta^T,  delta = beta * (v - decay * S^T k)
    for u in range(j):
        if PIPELINE:   # entry u + 1 (unused after the last: an in-bounds ring row) in flight during entry u
            nr_k, nr_v, x, y = _load_replayed(p_pend, (first_replayed + u + 1) % R, stride_pe, i_hk, i_hv, o_k,
                                              o_v, m_k, m_v, K, V, HK, HV)
        else:
            r_k, r_v, x, y = _load_replayed(p_pend, (first_replayed + u) % R, stride_pe, i_hk, i_hv, o_k, o_v,
                                            m_k, m_v, K, V, HK, HV)
            r_k = _l2normed(r_k)
            decay, beta = _gates(x, y, neg_A, dt_bias)
        delta = beta * (r_v - decay * tl.sum(b_h * r_k[:, None], axis=0))           # [BV]
        b_h = b_h * decay + r_k[:, None] * delta[None, :]
        if PIPELINE:
            r_v, r_k = nr_v, _l2normed(nr_k)
            decay, beta = _gates(x, y, neg_A, dt_bias)
    if PIPELINE:
        b_q, b_k, b_v = _l2normed(n_q) * scale, _l2normed(n_k), n_v
        decay, beta = _gates(nx, ny, neg_A, dt_bias)
    # This step's tokens. Both reductions read the old S, side by side (one dependent reduction per token):
    #   S' = decay * S + k delta^T,   delta = beta * (v - decay * S^T k),   o = S'^T q = decay * S^T q + (q.k) delta
    for t in range(bos, stop):
        if PIPELINE:
            n_q, n_k, n_v, nx, ny = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, t + 1, stop, first_saved,
                                                pos0, bos, i_v, i_hk, i_hv, o_k, o_v, m_k, m_v, stride_qt, stride_qh,
                                                stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
                                                stride_pe, R, GROUP, K, V, HK, HV)
        else:
            b_q, b_k, b_v, x, y = _load_token(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, p_pend, t, stop, first_saved, pos0,
                                              bos, i_v, i_hk, i_hv, o_k, o_v, m_k, m_v, stride_qt, stride_qh,
                                              stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
                                              stride_pe, R, GROUP, K, V, HK, HV)
            b_q, b_k = _l2normed(b_q) * scale, _l2normed(b_k)
            decay, beta = _gates(x, y, neg_A, dt_bias)
        s_k = tl.sum(b_h * b_k[:, None], axis=0)                                   # [BV]
        s_q = tl.sum(b_h * b_q[:, None], axis=0)                                   # [BV]
        delta = beta * (b_v - decay * s_k)                                         # [BV]
        b_o = decay * s_q + tl.sum(b_q * b_k) * delta                              # [BV]
        b_h = b_h * decay + b_k[:, None] * delta[None, :]
        tl.store(out_ptr + t * stride_ot + i_hv * stride_oh + o_v, b_o.to(out_ptr.dtype.element_ty), mask=m_v)
        if t == first_saved:                                                       # the committed state
            tl.store(p_h, b_h, mask=m_h)
        if PIPELINE:
            b_q, b_k, b_v = _l2normed(n_q) * scale, _l2normed(n_k), n_v
            decay, beta = _gates(nx, ny, neg_A, dt_bias)
    if REPLAY_ONLY:
        if live:
            tl.store(p_h, b_h, mask=m_h)


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, pending: torch.Tensor,
    cu_seqlens: torch.Tensor, slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor,
    positions: torch.Tensor, max_seqlen: int,
    *, replay_only: bool = False, block_v: int | None = None, num_warps: int | None = None,
    pipeline: bool | None = None, out: torch.Tensor | None = None, skip: torch.Tensor | None = None,
    max_replays: int | None = None,
) -> torch.Tensor:
    """Shapes as in `gated_delta_rule_ref`; q/k/v/a/b may be row-strided views (last dim contiguous).
    `replay_only`: only fold the replayed drafts into state[slot] (before a kernel that starts from state[slot],
    fla-core's chunk prefill); no token runs, the output is left as it is. `block_v`, `num_warps`, `pipeline` are for
    the benchmark and tests (None: `launch_config`'s choice); `out` [T, HV, V] lets a test pre-fill the output.
    `skip` [N, 4] int32: sequences (column 0; -1 for none) to leave alone: no token, no state, no output.
    `max_replays`: the most drafts any sequence replays (the caller's host knowledge; None: as many as the ring
    allows, R / 2 - 1). Only the launch config reads it: a wrong value costs speed, never correctness."""
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
    replays = ring // 2 - 1 if max_replays is None else min(max_replays, ring // 2 - 1)
    chosen = launch_config(num_seqs, max_seqlen + replays)
    block_v = min(chosen[0] if block_v is None else block_v, triton.next_power_of_2(head_v))
    num_warps = chosen[1] if num_warps is None else num_warps
    pipeline = chosen[2] if pipeline is None else pipeline
    grid = (triton.cdiv(head_v, block_v), num_seqs * num_v_heads)
    _gdn_recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, pending, out, cu_seqlens, slots, read_offsets, num_drafts, positions,
        cu_seqlens if skip is None else skip,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), pending.stride(0), pending.stride(1),
        out.stride(0), out.stride(1),
        head_k ** -0.5,
        HK=num_k_heads, HV=num_v_heads, GROUP=num_v_heads // num_k_heads, K=head_k, V=head_v, R=ring,
        BK=triton.next_power_of_2(head_k), BV=block_v, PIPELINE=pipeline, REPLAY_ONLY=replay_only,
        NUM_SKIP=0 if skip is None else skip.shape[0], num_warps=num_warps,
    )
    return out
