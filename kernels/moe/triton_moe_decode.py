"""Triton routed experts for a few tokens (decode and verify steps): one GEMV per token-expert pair, no sort
(same signature as the reference).

The grouped kernels (triton_moe.py) sort pairs into blocks first: a dozen small launches that cost more than a
decode step's expert GEMVs. With few pairs each expert is reached by about one pair, so:
  1. `_gate_up_gemv_kernel`, grid (P, I / BLOCK_N): inter[p] = silu(x_t · G_eᵀ) · (x_t · U_eᵀ)  for p = t·K + j,
     e = ids[p]; the programs of one output tile are launched together, so a second pair of the same expert
     finds its rows in L2.
  2. `_down_gemv_kernel`, grid (T, H / BLOCK_N): out_t = Σ_j w_p · (inter[p] · D_eᵀ), j in order (a fixed-order
     sum: no atomics), plus the gated shared expert sigmoid(g_t) · s_t when given.
Each program reads its weight rows once, as [BLOCK_N, BLOCK_K] tiles multiplied by the input in fp32 and
summed along K at the end. Rounding follows the grouped kernels and the torch reference: gate and up rounded
to the model dtype before silu·up, each expert's down output before its routing weight, the routed sum before
the shared expert is added.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvTiles:
    block_n: int     # output rows per program
    block_k: int     # reduction columns per loop step
    num_warps: int = 4


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, ids_ptr, inter_ptr, hidden, inter_size, stride_xt, stride_we, stride_wn,
                         stride_ip, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    p_gate = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn           # [BLOCK_N, 1] gate rows n
    p_up = p_gate + inter_size * stride_wn                                               # up rows I + n
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + token * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]   # [1, BLOCK_K]
        w_ok = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(p_gate + k[None, :], mask=w_ok, other=0.0).to(tl.float32) * a
        acc_u += tl.load(p_up + k[None, :], mask=w_ok, other=0.0).to(tl.float32) * a
    dtype = inter_ptr.dtype.element_ty
    g = tl.sum(acc_g, 1).to(dtype).to(tl.float32)                                        # [BLOCK_N]
    u = tl.sum(acc_u, 1).to(dtype).to(tl.float32)
    h = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u
    tl.store(inter_ptr + pair * stride_ip + n, h.to(dtype), mask=n_ok)


@triton.jit
def _down_gemv_kernel(inter_ptr, w_ptr, ids_ptr, topk_weights_ptr, shared_ptr, shared_gate_ptr, out_ptr,
                      hidden, inter_size, stride_ip, stride_we, stride_wn, stride_st, stride_gt, stride_ot,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SHARED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    routed = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        p_w = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn           # [BLOCK_N, 1]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter_size
            a = tl.load(inter_ptr + pair * stride_ip + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(p_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a
        weight = tl.load(topk_weights_ptr + pair).to(dtype).to(tl.float32)
        routed += tl.sum(acc, 1).to(dtype).to(tl.float32) * weight
    out = routed.to(dtype).to(tl.float32)
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(shared_gate_ptr + token * stride_gt).to(tl.float32)).to(dtype).to(tl.float32)
        s = tl.load(shared_ptr + token * stride_st + n, mask=n_ok, other=0.0).to(tl.float32)
        out += (s * gate).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + n, out.to(dtype), mask=n_ok)


def choose_tiles(num_rows: int, num_cols: int) -> GemvTiles:
    """Tiles of a GEMV with `num_rows` outputs over `num_cols` inputs (host ints: static per model)."""
    return GemvTiles(block_n=16 if num_rows >= 1024 else 8, block_k=min(256, triton.next_power_of_2(num_cols)))


def moe_experts_decode_triton(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K]
    shared: torch.Tensor | None = None,       # [T, H]
    shared_gate: torch.Tensor | None = None,  # [T, 1]
    tiles: tuple[GemvTiles, GemvTiles] | None = None,  # (gate_up, down); None: choose_tiles
) -> torch.Tensor:               # [T, H]
    num_tokens, hidden = x.shape
    inter_size, top_k = gate_up.shape[1] // 2, topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("shared", shared)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"moe_experts: {name} needs a contiguous last dimension (strides {t.stride()})")
    up_tiles, down_tiles = tiles or (choose_tiles(inter_size, hidden), choose_tiles(hidden, inter_size))
    ids = topk_ids.reshape(-1).contiguous()                                                  # [P]
    weights = topk_weights.reshape(-1).float().contiguous()                                  # [P]
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=x.dtype, device=x.device)      # [P, I]
    out = torch.empty_like(x)                                                                # [T, H]
    _gate_up_gemv_kernel[(num_tokens * top_k, triton.cdiv(inter_size, up_tiles.block_n))](
        x, gate_up, ids, inter, hidden, inter_size, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        inter.stride(0), TOP_K=top_k, BLOCK_N=up_tiles.block_n, BLOCK_K=up_tiles.block_k,
        num_warps=up_tiles.num_warps)
    has_shared = shared is not None
    _down_gemv_kernel[(num_tokens, triton.cdiv(hidden, down_tiles.block_n))](
        inter, down, ids, weights, shared if has_shared else x, shared_gate if has_shared else weights, out,
        hidden, inter_size, inter.stride(0), down.stride(0), down.stride(1),
        shared.stride(0) if has_shared else 0, shared_gate.stride(0) if has_shared else 0, out.stride(0),
        TOP_K=top_k, BLOCK_N=down_tiles.block_n, BLOCK_K=down_tiles.block_k, HAS_SHARED=has_shared,
        num_warps=down_tiles.num_warps)
    return out
