"""Triton routed experts for a few pairs per expert (wide decode and verify steps): one program per (expert, output
tile) finds its pairs by scanning the routing ids, so each reached expert's weights are read once for all its
pairs, without the sort's launches (same signature as the reference).

Between the per-pair GEMVs (triton_moe_decode.py, which read an expert once per pair) and the grouped GEMMs over
pairs sorted by expert (triton_moe.py, a dozen small launches to sort): per program,
    mine[p] = ids[p] == e,  rank[p] = Σ_{q ≤ p} mine[q] − 1        (p < P, one vector of P_PAD ids)
    chunk c: rows r = c·BLOCK_M .. c·BLOCK_M + BLOCK_M − 1  →  pair[r] = the p with mine[p] and rank[p] = r
  1. `_gate_up_scan_kernel`, grid (E, I / BLOCK_N): inter[p] = silu(x_t · G_eᵀ) · (x_t · U_eᵀ)  for e's pairs p
  2. `_down_scan_kernel`,    grid (E, H / BLOCK_N): pair_out[p] = w_p · (inter[p] · D_eᵀ)
  3. `_combine_kernel`,      grid (T, H / 256):    out_t = Σ_j pair_out[t·K + j] in order (no atomics)
                                                     [+ sigmoid(g_t) · s_t]
A shared expert given as weights of the experts' width is program E of kernels 1 and 2, whose rows are every token
(rows P + t); otherwise its output is added in kernel 3. An expert no pair reached scans and stores nothing.
FP8 experts' tiles are scaled into the model's dtype as they are read (fp8_blocks.py). Rounding follows the
grouped kernels and the reference.
"""
import torch
import triton
import triton.language as tl

from .fp8_blocks import block_k_for, row_scales, scale_operands
from .reference import ExpertScales, SharedExpert
from .triton_moe_decode import plus_gated_shared, shared_operands


@triton.jit
def _scan(ids_ptr, num_pairs, P_PAD: tl.constexpr):
    """This program's expert, its pairs' ranks among its pairs and their count."""
    expert = tl.program_id(0)
    p = tl.arange(0, P_PAD)
    mine = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) == expert
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1
    return expert.to(tl.int64), p, mine, rank, tl.sum(mine.to(tl.int32), 0)


@triton.jit
def _chunk(p, mine, rank, start, BLOCK_M: tl.constexpr):
    """Pair ids of this expert's rows start .. start + BLOCK_M − 1, and which rows exist."""
    r = start + tl.arange(0, BLOCK_M)
    hit = mine[None, :] & (rank[None, :] == r[:, None])                                   # [BLOCK_M, P_PAD]
    pair = tl.sum(tl.where(hit, p[None, :], 0), 1).to(tl.int64)                           # [BLOCK_M]
    return pair, tl.max(hit.to(tl.int32), 1) > 0


@triton.jit
def _rows(p, mine, rank, start, is_shared, num_pairs, num_tokens, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """(token, row, exists) of this program's rows start .. start + BLOCK_M − 1: an expert's pairs (row = pair), or
    for the shared expert's program every token (row P + t)."""
    if is_shared:
        token = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = token < num_tokens
        row = num_pairs + token
    else:
        row, ok = _chunk(p, mine, rank, start, BLOCK_M)
        token = row // TOP_K
    return token, row, ok


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs", "num_tokens"])
def _gate_up_scan_kernel(x_ptr, w_ptr, shared_w_ptr, ids_ptr, inter_ptr, scale_ptr, num_pairs, num_tokens,
                         num_experts, hidden, inter_size, stride_xt, stride_we, stride_wn, stride_sn, stride_ir,
                         stride_se, stride_sr, TOP_K: tl.constexpr, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
                         B0: tl.constexpr, B1: tl.constexpr):
    expert, p, mine, rank, count = _scan(ids_ptr, num_pairs, P_PAD)
    is_shared = expert == num_experts                       # the program past the experts: the shared expert
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    if is_shared:
        p_gate = shared_w_ptr + n[None, :].to(tl.int64) * stride_sn                         # gate rows n
        p_up = p_gate + inter_size * stride_sn                                               # up rows I + n
        count = num_tokens
    else:
        p_gate = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
        p_up = p_gate + inter_size * stride_wn
    dtype = inter_ptr.dtype.element_ty
    for start in range(0, count, BLOCK_M):
        token, row, row_ok = _rows(p, mine, rank, start, is_shared, num_pairs, num_tokens, TOP_K, BLOCK_M)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            b_g = tl.load(p_gate + k[:, None], mask=w_mask, other=0.0)                        # [BLOCK_K, BLOCK_N]
            b_u = tl.load(p_up + k[:, None], mask=w_mask, other=0.0)
            if SCALED:   # FP8 experts (the shared expert's program exists only when it is plain)
                s_g = row_scales(scale_ptr, expert, n, n_ok, k0, stride_se, stride_sr, B0, B1)
                s_u = row_scales(scale_ptr, expert, n + inter_size, n_ok, k0, stride_se, stride_sr, B0, B1)
                b_g = (b_g.to(tl.float32) * s_g[None, :]).to(dtype)
                b_u = (b_u.to(tl.float32) * s_u[None, :]).to(dtype)
            if IEEE:
                acc_g += tl.dot(a, b_g, input_precision="ieee")
                acc_u += tl.dot(a, b_u, input_precision="ieee")
            else:
                acc_g += tl.dot(a, b_g)
                acc_u += tl.dot(a, b_u)
        g = acc_g.to(dtype).to(tl.float32)
        u = acc_u.to(dtype).to(tl.float32)
        h = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u
        tl.store(inter_ptr + row[:, None] * stride_ir + n[None, :], h.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs", "num_tokens"])
def _down_scan_kernel(inter_ptr, w_ptr, shared_w_ptr, ids_ptr, topk_weights_ptr, pair_out_ptr, scale_ptr, num_pairs,
                      num_tokens, num_experts, hidden, inter_size, stride_ir, stride_we, stride_wn, stride_sn,
                      stride_pr, stride_se, stride_sr, TOP_K: tl.constexpr, P_PAD: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                      SCALED: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr):
    expert, p, mine, rank, count = _scan(ids_ptr, num_pairs, P_PAD)
    is_shared = expert == num_experts
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    if is_shared:
        p_w = shared_w_ptr + n[None, :].to(tl.int64) * stride_sn
        count = num_tokens
    else:
        p_w = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
    dtype = inter_ptr.dtype.element_ty
    for start in range(0, count, BLOCK_M):
        token, row, row_ok = _rows(p, mine, rank, start, is_shared, num_pairs, num_tokens, TOP_K, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter_size
            a = tl.load(inter_ptr + row[:, None] * stride_ir + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(p_w + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)        # [BLOCK_K, BLOCK_N]
            if SCALED:
                s = row_scales(scale_ptr, expert, n, n_ok, k0, stride_se, stride_sr, B0, B1)
                b = (b.to(tl.float32) * s[None, :]).to(dtype)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        # routed rows carry their routing weight (rounded to the model dtype); the shared expert's rows none
        routed_w = tl.load(topk_weights_ptr + row, mask=row_ok & (row < num_pairs), other=0.0).to(dtype)
        weight = tl.where(row < num_pairs, routed_w.to(tl.float32), 1.0)                          # [BLOCK_M]
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        tl.store(pair_out_ptr + row[:, None] * stride_pr + n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _combine_kernel(pair_out_ptr, shared_out_ptr, shared_gate_ptr, out_ptr, num_pairs, hidden, stride_pr, stride_st,
                    stride_gt, stride_ot, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, SHARED: tl.constexpr):
    """out_t = Σ_j pair_out[t·K + j] in order, rounded, [+ sigmoid(g_t) · s_t]; SHARED: 0 none, 1 s given (its
    output), 2 s in pair_out row P + t (fused)."""
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    routed = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        routed += tl.load(pair_out_ptr + (token * TOP_K + j) * stride_pr + n, mask=n_ok, other=0.0)
    out = routed.to(dtype).to(tl.float32)
    if SHARED != 0:
        if SHARED == 1:
            s = tl.load(shared_out_ptr + token * stride_st + n, mask=n_ok, other=0.0).to(tl.float32)
        else:
            s = tl.load(pair_out_ptr + (num_pairs + token) * stride_pr + n, mask=n_ok, other=0.0)
        out = plus_gated_shared(out, s, shared_gate_ptr, token, stride_gt, out_ptr)
    tl.store(out_ptr + token * stride_ot + n, out.to(dtype), mask=n_ok)


def moe_experts_scan_triton(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K]
    shared: SharedExpert | None = None,
    scales: ExpertScales | None = None,   # FP8 experts' block scales
    block_n: int = 64,           # 64 x 64 tiles: the best or near it in a sweep at both MoE shapes (bench/README.md)
    block_k: int = 64,
) -> torch.Tensor:               # [T, H]
    num_tokens, hidden = x.shape
    num_experts, inter_size, top_k = gate_up.shape[0], gate_up.shape[1] // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        out = torch.zeros_like(x)
        return out if shared is None else shared.added(out, x)
    block_k = block_k_for(scales, block_k)
    fp8 = scale_operands(scales, gate_up, down, block_k)
    ids = topk_ids.reshape(-1).contiguous()                                                   # [P]
    weights = topk_weights.reshape(-1).float().contiguous()                                   # [P]
    ops = shared_operands(shared, x, gate_up, down, weights, fp8.scaled)
    rows = num_pairs + (num_tokens if ops.fused else 0)                                       # pairs, then shared
    inter = torch.empty(rows, inter_size, dtype=x.dtype, device=x.device)                     # [rows, I]
    pair_out = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)                # [rows, H]
    out = torch.empty_like(x)                                                                 # [T, H]
    programs = num_experts + (1 if ops.fused else 0)                                          # + the shared expert
    common = dict(P_PAD=triton.next_power_of_2(num_pairs), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                  IEEE=x.dtype == torch.float32, TOP_K=top_k, SCALED=fp8.scaled, B0=fp8.block[0], B1=fp8.block[1],
                  num_warps=4)
    gu_scale, gu_se, gu_sr = fp8.gate_up_args()
    d_scale, d_se, d_sr = fp8.down_args()
    _gate_up_scan_kernel[(programs, triton.cdiv(inter_size, block_n))](
        x, gate_up, ops.gate_up, ids, inter, gu_scale, num_pairs, num_tokens, num_experts, hidden, inter_size,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), ops.gate_up.stride(0), inter.stride(0), gu_se, gu_sr,
        **common)
    _down_scan_kernel[(programs, triton.cdiv(hidden, block_n))](
        inter, down, ops.down, ids, weights, pair_out, d_scale, num_pairs, num_tokens, num_experts, hidden,
        inter_size, inter.stride(0), down.stride(0), down.stride(1), ops.down.stride(0), pair_out.stride(0), d_se,
        d_sr, **common)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, 256))](
        pair_out, ops.output, ops.gate, out, num_pairs, hidden, pair_out.stride(0), ops.output.stride(0),
        ops.gate.stride(0), out.stride(0), TOP_K=top_k, BLOCK_N=256, SHARED=ops.mode, num_warps=4)
    return out
