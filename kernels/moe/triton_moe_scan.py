"""Triton routed experts for a few pairs per expert (wide decode and verify steps): one program per (expert, output
tile) finds its pairs by scanning the routing ids, so each reached expert's weights are read once for all its
pairs, without the sort's launches (same signature as the reference).

Between the per-pair GEMVs (triton_moe_decode.py, which read an expert once per pair) and the grouped GEMMs over
pairs sorted by expert (triton_moe.py, a dozen small launches to sort): per program,
    mine[p] = ids[p] == e,  rank[p] = Σ_{q ≤ p} mine[q] − 1        (p < P, one vector of P_PAD ids)
    chunk c: rows r = c·BLOCK_M .. c·BLOCK_M + BLOCK_M − 1  →  pair[r] = the p with mine[p] and rank[p] = r
  1. `_gate_up_scan_kernel`, grid (E, I / BLOCK_N): inter[p] = silu(x_t · G_eᵀ) · (x_t · U_eᵀ)  for e's pairs p
  2. `_down_scan_kernel`,    grid (E, H / BLOCK_N): pair_out[p] = w_p · (inter[p] · D_eᵀ)
  3. out_t = Σ_j pair_out[t·K + j] (a fixed-order sum, no atomics), then the shared expert, in torch
An expert no pair reached scans and stores nothing. Rounding follows the grouped kernels.
"""
import torch
import triton
import triton.language as tl

from .reference import SharedExpert


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


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_scan_kernel(x_ptr, w_ptr, ids_ptr, inter_ptr, num_pairs, hidden, inter_size, stride_xt, stride_we,
                         stride_wn, stride_ip, TOP_K: tl.constexpr, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    expert, p, mine, rank, count = _scan(ids_ptr, num_pairs, P_PAD)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    p_w = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn                  # gate rows n
    dtype = inter_ptr.dtype.element_ty
    for start in range(0, count, BLOCK_M):
        pair, row_ok = _chunk(p, mine, rank, start, BLOCK_M)
        token = pair // TOP_K
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            b_g = tl.load(p_w + k[:, None], mask=w_mask, other=0.0)                           # [BLOCK_K, BLOCK_N]
            b_u = tl.load(p_w + inter_size * stride_wn + k[:, None], mask=w_mask, other=0.0)  # up rows I + n
            if IEEE:
                acc_g += tl.dot(a, b_g, input_precision="ieee")
                acc_u += tl.dot(a, b_u, input_precision="ieee")
            else:
                acc_g += tl.dot(a, b_g)
                acc_u += tl.dot(a, b_u)
        g = acc_g.to(dtype).to(tl.float32)
        u = acc_u.to(dtype).to(tl.float32)
        h = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u
        tl.store(inter_ptr + pair[:, None] * stride_ip + n[None, :], h.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs"])
def _down_scan_kernel(inter_ptr, w_ptr, ids_ptr, topk_weights_ptr, pair_out_ptr, num_pairs, hidden, inter_size,
                      stride_ip, stride_we, stride_wn, stride_pt, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    expert, p, mine, rank, count = _scan(ids_ptr, num_pairs, P_PAD)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    p_w = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
    dtype = inter_ptr.dtype.element_ty
    for start in range(0, count, BLOCK_M):
        pair, row_ok = _chunk(p, mine, rank, start, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter_size
            a = tl.load(inter_ptr + pair[:, None] * stride_ip + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(p_w + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)        # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(dtype).to(tl.float32)  # [BLOCK_M]
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        tl.store(pair_out_ptr + pair[:, None] * stride_pt + n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


def moe_experts_scan_triton(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K]
    shared: SharedExpert | None = None,
    block_n: int = 64,           # 64 x 64 tiles: the best of a sweep at both MoE shapes, 64-1280 pairs
    block_k: int = 64,
) -> torch.Tensor:               # [T, H]
    num_tokens, hidden = x.shape
    num_experts, inter_size, top_k = gate_up.shape[0], gate_up.shape[1] // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        out = torch.zeros_like(x)
        return out if shared is None else shared.added(out, x)
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if t.stride(-1) != 1:
            raise ValueError(f"moe_experts: {name} needs a contiguous last dimension (strides {t.stride()})")
    ids = topk_ids.reshape(-1).contiguous()                                                   # [P]
    weights = topk_weights.reshape(-1).float().contiguous()                                   # [P]
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)                # [P, I]
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)           # [P, H]
    ieee, p_pad = x.dtype == torch.float32, triton.next_power_of_2(num_pairs)
    common = dict(P_PAD=p_pad, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=4)
    _gate_up_scan_kernel[(num_experts, triton.cdiv(inter_size, block_n))](
        x, gate_up, ids, inter, num_pairs, hidden, inter_size, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        inter.stride(0), TOP_K=top_k, **common)
    _down_scan_kernel[(num_experts, triton.cdiv(hidden, block_n))](
        inter, down, ids, weights, pair_out, num_pairs, hidden, inter_size, inter.stride(0), down.stride(0),
        down.stride(1), pair_out.stride(0), **common)
    out = pair_out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
    return out if shared is None else shared.added(out, x)
