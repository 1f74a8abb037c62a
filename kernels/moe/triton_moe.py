"""Triton grouped expert GEMMs for the routed experts of a sparse MoE block (same signature as the reference).

Pairs are sorted by expert into padded blocks of BLOCK_M rows (`routing.sort_pairs_by_expert`, device only). Then:
  1. `_gate_up_kernel`, grid (blocks, I / BLOCK_N):  inter[r] = silu(x_t · G_eᵀ) · (x_t · U_eᵀ)  for row r = pair (t, j)
  2. `_down_kernel`,    grid (blocks, H / BLOCK_N):  pair_out[p] = w_p · (inter[r] · D_eᵀ)
  3. out_t = Σ_j pair_out[t·K + j]   (a fixed-order sum: no atomics, so a token's result never depends on its
     batch mates or on scheduling)
A block whose expert is the sentinel E (past the used experts) runs its K loop zero times and, since all its rows
are padding (pair id P), stores nothing: the grid is a static upper bound yet only used experts' weights are read.
FP8 experts' tiles are scaled into the model's dtype as they are read (fp8_blocks.py). Rounding follows the torch
reference:
gate and up are rounded to the model dtype before silu·up, the down output before the routing weight.
"""
import torch
import triton
import triton.language as tl

from .fp8_blocks import block_k_for, row_scales, scale_operands
from .reference import ExpertScales, SharedExpert
from .routing import sort_pairs_by_expert


@triton.jit
def _block(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block: its expert (E for a sentinel block), rows, their pair ids and which are real."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    return expert, rows, pair, pair < num_pairs


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x_ptr, w_ptr, inter_ptr, sorted_pairs_ptr, block_experts_ptr, scale_ptr,
                    num_pairs, num_experts, hidden, inter_size, stride_xt, stride_we, stride_wn, stride_ir,
                    stride_se, stride_sr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, B0: tl.constexpr,
                    B1: tl.constexpr):
    expert, rows, pair, row_ok = _block(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    pid_n = tl.program_id(1)
    token = (pair // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    num_k = tl.where(expert < num_experts, tl.cdiv(hidden, BLOCK_K), 0)
    p_w = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn                      # gate rows n
    dtype = inter_ptr.dtype.element_ty
    for kk in range(0, num_k):
        k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        b_g = tl.load(p_w + k[:, None], mask=w_mask, other=0.0)                                  # [BLOCK_K, BLOCK_N]
        b_u = tl.load(p_w + inter_size * stride_wn + k[:, None], mask=w_mask, other=0.0)         # up rows I + n
        if SCALED:   # FP8 experts
            s_g = row_scales(scale_ptr, expert, n, n_ok, kk * BLOCK_K, stride_se, stride_sr, B0, B1)
            s_u = row_scales(scale_ptr, expert, n + inter_size, n_ok, kk * BLOCK_K, stride_se, stride_sr, B0, B1)
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
    ok = row_ok[:, None] & n_ok[None, :]
    tl.store(inter_ptr + rows[:, None] * stride_ir + n[None, :], h.to(dtype), mask=ok)


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(inter_ptr, w_ptr, topk_weights_ptr, pair_out_ptr, sorted_pairs_ptr, block_experts_ptr, scale_ptr,
                 num_pairs, num_experts, hidden, inter_size, stride_ir, stride_we, stride_wn, stride_pt, stride_se,
                 stride_sr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 SCALED: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr):
    expert, rows, pair, row_ok = _block(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    num_k = tl.where(expert < num_experts, tl.cdiv(inter_size, BLOCK_K), 0)
    p_w = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
    dtype = inter_ptr.dtype.element_ty
    for kk in range(0, num_k):
        k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < inter_size
        a = tl.load(inter_ptr + rows[:, None] * stride_ir + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(p_w + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)            # [BLOCK_K, BLOCK_N]
        if SCALED:
            s = row_scales(scale_ptr, expert, n, n_ok, kk * BLOCK_K, stride_se, stride_sr, B0, B1)
            b = (b.to(tl.float32) * s[None, :]).to(dtype)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(dtype).to(tl.float32)  # [BLOCK_M]
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    ok = row_ok[:, None] & n_ok[None, :]
    tl.store(pair_out_ptr + pair.to(tl.int64)[:, None] * stride_pt + n[None, :], y, mask=ok)


def tile_config(num_pairs: int, num_experts: int) -> dict:
    """Rows per block from the mean pairs per expert (host ints: static for a CUDA-graph bucket)."""
    per_expert = num_pairs / max(1, num_experts)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=32 if block_m == 16 else 64, BLOCK_K=64,
                num_warps=4 if block_m < 64 else 8)


def moe_experts_triton(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K]
    shared: SharedExpert | None = None,
    scales: ExpertScales | None = None,   # FP8 experts' block scales
) -> torch.Tensor:               # [T, H]
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter_size, top_k = two_inter // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        out = torch.zeros_like(x)
        return out if shared is None else shared.added(out, x)
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if t.stride(-1) != 1:
            raise ValueError(f"moe_experts: {name} needs a contiguous last dimension (strides {t.stride()})")
    cfg = tile_config(num_pairs, num_experts)
    block_m, block_n, block_k, num_warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
    block_k = block_k_for(scales, block_k)
    fp8 = scale_operands(scales, gate_up, down, block_k)
    gu_scale, gu_se, gu_sr = fp8.gate_up_args()
    d_scale, d_se, d_sr = fp8.down_args()
    scaled = dict(SCALED=fp8.scaled, B0=fp8.block[0], B1=fp8.block[1])
    sorted_pairs, block_experts = sort_pairs_by_expert(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    weights = topk_weights.reshape(-1).float().contiguous()                                   # [P]
    inter = torch.empty(sorted_pairs.shape[0], inter_size, dtype=x.dtype, device=x.device)    # [rows, I]
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)           # [P, H]
    ieee = x.dtype == torch.float32
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        x, gate_up, inter, sorted_pairs, block_experts, gu_scale, num_pairs, num_experts, hidden, inter_size,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0), gu_se, gu_sr,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=num_warps, **scaled)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter, down, weights, pair_out, sorted_pairs, block_experts, d_scale, num_pairs, num_experts, hidden,
        inter_size, inter.stride(0), down.stride(0), down.stride(1), pair_out.stride(0), d_se, d_sr,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=num_warps, **scaled)
    out = pair_out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
    return out if shared is None else shared.added(out, x)
