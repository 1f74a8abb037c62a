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
    fixed-length call over all T rows, so no chunk index is built on the host and the call can be captured.

    Padding rows get beta = 0 and g = 0 (and zero q, k, v: the rows may hold anything, NaN included), and the delta
    rule leaves the state alone on them: S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = S_{t-1}.
    So the final state is the state after the sequence's last real token. Their outputs are padding."""
    chunk = fla_chunk_kernel()
    if chunk is None:
        raise RuntimeError("chunk_gated_delta_rule_one_fla needs fla-core (pip install fla-core)")
    num_tokens = q.shape[0]
    live = torch.arange(num_tokens, device=q.device) < cu_seqlens[1]                     # [T] bool
    g, beta = gdn_gating(a, b, A_log, dt_bias)                                          # [T, HV] fp32
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    g, beta = torch.where(live[:, None], g, zero), torch.where(live[:, None], beta, zero)
    q, k, v = (torch.where(live[:, None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
               for x in (q, k, v))                                                      # contiguous copies
    slot = slots[:1].long()
    o, final = chunk(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                     initial_state=state[slot], output_final_state=True, use_qk_l2norm_in_kernel=True)
    state[slot] = final.float()
    return o[0].to(v.dtype)


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
