"""Triton routed experts for a few tokens (decode and verify steps): one GEMV per token-expert pair, no sort
(same signature as the reference).

The grouped kernels (triton_moe.py) sort pairs into blocks first: a dozen small launches that cost more than a
decode step's expert GEMVs. With few pairs each expert is reached by about one pair, so:
  1. `_gate_up_gemv_kernel`, grid (P, I / BLOCK_N): inter[p] = silu(x_t · G_eᵀ) · (x_t · U_eᵀ)  for p = t·K + j,
     e = ids[p]; the programs of one output tile are launched together, so a second pair of the same expert
     finds its rows in L2.
  2. `_down_gemv_kernel`, grid (T, H / BLOCK_N): out_t = Σ_j w_p · (inter[p] · D_eᵀ), j in order (a fixed-order
     sum: no atomics), plus the gated shared expert sigmoid(g_t) · s_t when given.
A shared expert given as weights of the experts' width is one more row per token: row P + t of kernel 1 (its
gate_up), and kernel 2 runs its down projection after the routed ones; so a MoE block's experts are two launches.
Each program reads its weight rows once, as [BLOCK_N, BLOCK_K] tiles multiplied by the input in fp32 and
summed along K at the end; FP8 experts' tiles are scaled into the model's dtype as they are read (fp8_blocks.py).
Rounding follows the grouped kernels and the torch reference: gate and up rounded to the model dtype before silu·up,
each expert's down output before its routing weight, the routed sum before the shared expert is added.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_blocks import block_k_for, row_scales, scale_operands
from .reference import ExpertScales, SharedExpert


@dataclass(frozen=True)
class GemvTiles:
    block_n: int     # output rows per program
    block_k: int     # reduction columns per loop step
    num_warps: int = 4


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_gemv_kernel(x_ptr, w_ptr, ids_ptr, shared_w_ptr, inter_ptr, scale_ptr, num_pairs, hidden, inter_size,
                         stride_xt, stride_we, stride_wn, stride_sn, stride_ip, stride_se, stride_sr,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SCALED: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)       # a pair p < P, or P + t: token t's shared expert
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter_size
    expert = tl.load(ids_ptr + tl.minimum(row, num_pairs - 1)).to(tl.int64)
    if row < num_pairs:
        token = row // TOP_K
        p_gate = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn       # [BLOCK_N, 1] gate rows n
        p_up = p_gate + inter_size * stride_wn                                           # up rows I + n
    else:
        token = row - num_pairs
        p_gate = shared_w_ptr + n[:, None].to(tl.int64) * stride_sn
        p_up = p_gate + inter_size * stride_sn
    dtype = inter_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + token * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]   # [1, BLOCK_K]
        w_ok = n_ok[:, None] & k_ok[None, :]
        w_g = tl.load(p_gate + k[None, :], mask=w_ok, other=0.0).to(tl.float32)                  # [BLOCK_N, BLOCK_K]
        w_u = tl.load(p_up + k[None, :], mask=w_ok, other=0.0).to(tl.float32)
        if SCALED:   # FP8 experts (never the shared expert: fused only when plain)
            s_g = row_scales(scale_ptr, expert, n, n_ok, k0, stride_se, stride_sr, B0, B1)
            s_u = row_scales(scale_ptr, expert, n + inter_size, n_ok, k0, stride_se, stride_sr, B0, B1)
            w_g = (w_g * s_g[:, None]).to(dtype).to(tl.float32)
            w_u = (w_u * s_u[:, None]).to(dtype).to(tl.float32)
        acc_g += w_g * a
        acc_u += w_u * a
    g = tl.sum(acc_g, 1).to(dtype).to(tl.float32)                                        # [BLOCK_N]
    u = tl.sum(acc_u, 1).to(dtype).to(tl.float32)
    h = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u
    tl.store(inter_ptr + row * stride_ip + n, h.to(dtype), mask=n_ok)


@triton.jit
def _down_row(inter_ptr, p_w, row, n, n_ok, inter_size, stride_ip, scale_ptr, expert, stride_se, stride_sr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr, B0: tl.constexpr,
              B1: tl.constexpr):
    """inter[row] · Wᵀ for the BLOCK_N weight rows n at p_w [BLOCK_N, 1], rounded to the model dtype, in fp32
    (SCALED: W is `expert`'s FP8 down projection)."""
    dtype = inter_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter_size
        a = tl.load(inter_ptr + row * stride_ip + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(p_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if SCALED:
            s = row_scales(scale_ptr, expert, n, n_ok, k0, stride_se, stride_sr, B0, B1)
            w = (w * s[:, None]).to(dtype).to(tl.float32)
        acc += w * a
    return tl.sum(acc, 1).to(dtype).to(tl.float32)


@triton.jit
def plus_gated_shared(out, s, shared_gate_ptr, token, stride_gt, out_ptr):
    """out + sigmoid(g_t) · s_t [BLOCK_N], the gate and the product rounded to the model dtype (out_ptr's) as the
    reference rounds them (the decode and scan kernels' last step)."""
    dtype = out_ptr.dtype.element_ty
    gate = tl.sigmoid(tl.load(shared_gate_ptr + token * stride_gt).to(tl.float32)).to(dtype).to(tl.float32)
    return out + (s * gate).to(dtype).to(tl.float32)


# num_pairs varies per step: not specialised on it, so a new value never compiles a new variant
@triton.jit(do_not_specialize=["num_pairs"])
def _down_gemv_kernel(inter_ptr, w_ptr, ids_ptr, topk_weights_ptr, shared_w_ptr, shared_out_ptr, shared_gate_ptr,
                      out_ptr, scale_ptr, num_pairs, hidden, inter_size, stride_ip, stride_we, stride_wn, stride_sn,
                      stride_st, stride_gt, stride_ot, stride_se, stride_sr, TOP_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SHARED: tl.constexpr,  # 0 none, 1 its output given, 2 its weights (row P + t)
                      SCALED: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    dtype = out_ptr.dtype.element_ty
    routed = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        p_w = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * stride_wn           # [BLOCK_N, 1]
        weight = tl.load(topk_weights_ptr + pair).to(dtype).to(tl.float32)
        routed += _down_row(inter_ptr, p_w, pair, n, n_ok, inter_size, stride_ip, scale_ptr, expert, stride_se,
                            stride_sr, BLOCK_N, BLOCK_K, SCALED, B0, B1) * weight
    out = routed.to(dtype).to(tl.float32)
    if SHARED != 0:
        if SHARED == 1:
            s = tl.load(shared_out_ptr + token * stride_st + n, mask=n_ok, other=0.0).to(tl.float32)
        else:
            p_w = shared_w_ptr + n[:, None].to(tl.int64) * stride_sn
            s = _down_row(inter_ptr, p_w, num_pairs + token, n, n_ok, inter_size, stride_ip, scale_ptr, 0, 0, 0,
                          BLOCK_N, BLOCK_K, False, 1, 1)
        out = plus_gated_shared(out, s, shared_gate_ptr, token, stride_gt, out_ptr)
    tl.store(out_ptr + token * stride_ot + n, out.to(dtype), mask=n_ok)


def choose_tiles(num_rows: int, num_cols: int, scales: ExpertScales | None = None) -> GemvTiles:
    """Tiles of a GEMV with `num_rows` outputs over `num_cols` inputs: 8 x 128, 8 warps, the best of a sweep at
    both MoE shapes, 1-16 tokens (bench/README.md, "MoE decode"); FP8 weights twice the rows, so that a tile
    moves as many bytes; narrower K tiles for tiny models and for FP8 blocks of fewer columns."""
    return GemvTiles(block_n=8 if scales is None else 16,
                     block_k=block_k_for(scales, min(128, triton.next_power_of_2(num_cols))), num_warps=8)


def fuses(shared: SharedExpert | None, gate_up: torch.Tensor) -> bool:
    """Whether the shared expert runs as one more GEMV row: given as weights of the experts' dtype and width."""
    return (shared is not None and shared.output is None and shared.gate_up.shape == gate_up.shape[1:]
            and shared.gate_up.dtype == gate_up.dtype and shared.down.dtype == gate_up.dtype)


@dataclass(frozen=True)
class SharedOperands:
    """The shared expert as the decode and scan kernels take it: `mode` 0 none, 1 its output added, 2 its weights
    run as one more row per token; the tensors to pass (the experts' own where the mode reads none)."""
    mode: int
    gate_up: torch.Tensor    # [2I, H]
    down: torch.Tensor       # [H, I]
    output: torch.Tensor     # [T, H]
    gate: torch.Tensor       # [T, 1]; the routing weights when mode is 0

    @property
    def fused(self) -> bool:
        return self.mode == 2


def shared_operands(shared: SharedExpert | None, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, scaled: bool = False) -> SharedOperands:
    """The operands of `shared` (its output computed here when its weights cannot be fused, or the experts are
    FP8: `scaled`), last dimensions checked contiguous with the experts'."""
    fused = fuses(shared, gate_up) and not scaled
    if shared is not None and not fused and shared.output is None:
        shared = SharedExpert(gate=shared.gate, output=shared.computed(x))
    mode = 0 if shared is None else 2 if fused else 1
    ops = SharedOperands(mode, shared.gate_up if fused else gate_up, shared.down if fused else down,
                         shared.output if mode == 1 else x, shared.gate if shared is not None else weights)
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("shared gate_up", ops.gate_up),
                    ("shared down", ops.down), ("shared output", ops.output)):
        if t.stride(-1) != 1:
            raise ValueError(f"moe_experts: {name} needs a contiguous last dimension (strides {t.stride()})")
    return ops


def moe_experts_decode_triton(
    x: torch.Tensor,             # [T, H]
    gate_up: torch.Tensor,       # [E, 2I, H]
    down: torch.Tensor,          # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] fp32
    topk_ids: torch.Tensor,      # [T, K]
    shared: SharedExpert | None = None,
    scales: ExpertScales | None = None,                # FP8 experts' block scales
    tiles: tuple[GemvTiles, GemvTiles] | None = None,  # (gate_up, down); None: choose_tiles
) -> torch.Tensor:               # [T, H]
    num_tokens, hidden = x.shape
    inter_size, top_k = gate_up.shape[1] // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        out = torch.zeros_like(x)
        return out if shared is None else shared.added(out, x)
    up_tiles, down_tiles = tiles or (choose_tiles(inter_size, hidden, scales), choose_tiles(hidden, inter_size, scales))
    fp8 = scale_operands(scales, gate_up, down, max(up_tiles.block_k, down_tiles.block_k))
    b0, b1 = fp8.block
    ids = topk_ids.reshape(-1).contiguous()                                                  # [P]
    weights = topk_weights.reshape(-1).float().contiguous()                                  # [P]
    ops = shared_operands(shared, x, gate_up, down, weights, fp8.scaled)
    rows = num_pairs + (num_tokens if ops.fused else 0)                                      # pairs, then shared
    inter = torch.empty(rows, inter_size, dtype=x.dtype, device=x.device)                    # [rows, I]
    out = torch.empty_like(x)                                                                # [T, H]
    gu_scale, gu_se, gu_sr = fp8.gate_up_args()
    d_scale, d_se, d_sr = fp8.down_args()
    _gate_up_gemv_kernel[(rows, triton.cdiv(inter_size, up_tiles.block_n))](
        x, gate_up, ids, ops.gate_up, inter, gu_scale, num_pairs, hidden, inter_size, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), ops.gate_up.stride(0), inter.stride(0), gu_se, gu_sr,
        TOP_K=top_k, BLOCK_N=up_tiles.block_n, BLOCK_K=up_tiles.block_k, SCALED=fp8.scaled, B0=b0, B1=b1,
        num_warps=up_tiles.num_warps)
    _down_gemv_kernel[(num_tokens, triton.cdiv(hidden, down_tiles.block_n))](
        inter, down, ids, weights, ops.down, ops.output, ops.gate, out, d_scale, num_pairs, hidden, inter_size,
        inter.stride(0), down.stride(0), down.stride(1), ops.down.stride(0), ops.output.stride(0),
        ops.gate.stride(0), out.stride(0), d_se, d_sr,
        TOP_K=top_k, BLOCK_N=down_tiles.block_n, BLOCK_K=down_tiles.block_k, SHARED=ops.mode,
        SCALED=fp8.scaled, B0=b0, B1=b1, num_warps=down_tiles.num_warps)
    return out
