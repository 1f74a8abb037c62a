"""Chunked gated delta rule for prefill: fla-core's `chunk_gated_delta_rule` when it is importable (an optional
GPU dependency, `pip install fla-core`), else our fused recurrent kernel. Same signature as the reference.

Only for steps without drafts (every num_drafts is 0), and after the drafts the step replays have been folded
into state[slot] (`gated_delta_rule(..., replay_only=True)`, which `gated_delta_rule_prefill` runs first):
initial states are gathered from state[slot], final states scattered back, which is what the reference gives
when d = 0 (the state after the last token; nothing to stash).

fla's varlen path derives chunk indices from cu_seqlens, reading them back from the device (a host sync) unless
they come from the host, and caches what it derives per cu_seqlens TENSOR. Given the step's cu_seqlens on the
host, the wrapper builds fla's int64 cu_seqlens and chunk index once per distinct length set and passes the same
tensors to every GDN layer of the step: no layer waits for the device, and fla's caches hit after the first.
Inside a CUDA graph there are no host offsets: `chunk_lanes_fla` runs chosen sequences of a ragged batch each as a
fixed-length call over all its rows, the others masked out (a prefill bucket's one sequence, or the prompt chunks
of a mixed step while the recurrent kernel runs its decoding sequences).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .reference import gdn_gating


@functools.cache
def fla_chunk_kernel():
    """fla-core's chunk_gated_delta_rule, or None when fla-core is not installed (or fails to import)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - an optional dependency may fail in many ways; the fallback is exact
        return None
    return chunk_gated_delta_rule


def chunk_gated_delta_rule_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, pending: torch.Tensor,
    cu_seqlens: torch.Tensor, slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor,
    positions: torch.Tensor, max_seqlen: int, cu_seqlens_host: np.ndarray | None = None,
) -> torch.Tensor:
    """Shapes as in `gated_delta_rule_ref` (`pending`, `read_offsets`, `positions` unused: see above); needs
    fla-core and CUDA tensors. `cu_seqlens_host`: the same offsets on the host (optional: without them fla reads
    them back from the device in every call)."""
    chunk = fla_chunk_kernel()
    if chunk is None:
        raise RuntimeError("chunk_gated_delta_rule_fla needs fla-core (pip install fla-core)")
    g, beta = gdn_gating(a, b, A_log, dt_bias)                                  # [T, HV] fp32
    slot = slots.long()
    initial = state[slot]                                                       # [B, HV, K, V] fp32
    index = ({"cu_seqlens": cu_seqlens.long()} if cu_seqlens_host is None else
             fla_varlen_index(tuple(int(x) for x in cu_seqlens_host), cu_seqlens.device))
    o, final = chunk(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g[None], beta[None],
                     scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True,
                     use_qk_l2norm_in_kernel=True, **index)
    state[slot] = final.float()
    return o[0].to(v.dtype)


def chunk_gated_delta_rule_one_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, pending: torch.Tensor,
    cu_seqlens: torch.Tensor, slots: torch.Tensor, read_offsets: torch.Tensor, num_drafts: torch.Tensor,
    positions: torch.Tensor, max_seqlen: int,
) -> torch.Tensor:
    """One sequence: its cu_seqlens[1] tokens first, padding after (a CUDA graph's prefill bucket). fla's
    fixed-length call over all T rows (`chunk_lanes_fla`), so no chunk index is built on the host and the call
    can be captured."""
    o, _ = chunk_lanes_fla(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens[:1], cu_seqlens[1:2], slots[:1])
    return o[0]


def chunk_lanes_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
    starts: torch.Tensor,   # [N] int32 first row of each lane's sequence
    ends: torch.Tensor,     # [N] int32 its end row (start = end: an unused lane)
    slots: torch.Tensor,    # [N] int32 its state row (an unused lane: a scratch row)
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences of a ragged batch, each as fla's fixed-length call over all T rows, the rows outside it masked:
    (o [N, T, HV, V], live [N, T] bool), o valid where live. Every shape is static (a CUDA graph captures it) and
    nothing is read back. Each sequence starts from state[slot], which must hold its state (no drafts to replay),
    and state[slot] gets its state after its last row.

    Masked rows get beta = 0 and g = 0 (and zero q, k, v: the rows may hold anything, NaN included), and the delta
    rule leaves the state alone on them: S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = S_{t-1}.
    So rows before the sequence keep its initial state, and the final state is the one after its last row."""
    chunk = fla_chunk_kernel()
    if chunk is None:
        raise RuntimeError("chunk_lanes_fla needs fla-core (pip install fla-core)")
    rows = torch.arange(q.shape[0], device=q.device)                                       # [T]
    live = (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])             # [N, T]
    g, beta = gdn_gating(a, b, A_log, dt_bias)                                              # [T, HV] fp32
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    g, beta = (torch.where(live[:, :, None], x[None], zero) for x in (g, beta))             # [N, T, HV]
    q, k, v = (torch.where(live[:, :, None, None], x[None], torch.zeros((), dtype=x.dtype, device=x.device))
               for x in (q, k, v))                                                          # [N, T, H, D]
    slot = slots.long()
    o, final = chunk(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state[slot],
                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    state[slot] = final.float()
    return o.to(v.dtype), live


FLA_CHUNK_SIZE = 64  # fla's chunk_gated_delta_rule default


@functools.lru_cache(maxsize=8)
def fla_varlen_index(cu_seqlens: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
    """fla's varlen arguments for these offsets [B + 1], built on the host: the same tensor objects for every
    layer of a step (and every step with the same lengths)."""
    from fla.ops.utils.index import prepare_chunk_indices
    cu_cpu = torch.tensor(cu_seqlens, dtype=torch.long).pin_memory()   # kept alive by the cache
    cu_device = cu_cpu.to(device, non_blocking=True)
    return {"cu_seqlens": cu_device, "cu_seqlens_cpu": cu_cpu,
            "chunk_indices": prepare_chunk_indices(cu_device, FLA_CHUNK_SIZE, cu_seqlens_cpu=cu_cpu)}
