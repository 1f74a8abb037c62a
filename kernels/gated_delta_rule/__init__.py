"""Gated delta rule (docs/architecture.md, "The model"): public entry points, dispatched by device.

    gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets, num_drafts,
                     positions, max_seqlen, *, replay_only=False, max_replays=None) -> [T, HV, V]
CUDA tensors run the Triton fused recurrent kernel (`fused_recurrent.py`), anything else the torch reference
(`reference.py`, which documents the state and the pending ring of drafts). `gated_delta_rule_prefill` (same
signature, steps without drafts only) runs fla-core's chunk kernel when it is installed and the tensors are on
CUDA, after folding the replayed drafts into the state, else `gated_delta_rule`. `gated_delta_rule_lanes` (same
signature plus a step's chunk lanes, specdec/models/forward_batch.py) runs the lanes' sequences through fla-core's
chunk kernel and the rest through the recurrent one, where both exist; else `gated_delta_rule` over them all.
`max_replays` (the most drafts a sequence of the step replays, None: unknown) only picks the Triton kernel's launch
config. The Triton module is imported on first CUDA use, so tests can set TRITON_INTERPRET=1 before importing it.
"""
import torch

from .reference import gated_delta_rule_ref, gdn_gating, l2norm


def launch_config(num_seqs: int, max_tokens: int) -> tuple[int, int, bool]:
    """The Triton recurrent kernel's (BV, warps, pipelined token loops) for `num_seqs` sequences of at most
    `max_tokens` virtual tokens (replayed drafts + the step's tokens), as measured on an H100 at the 4B shape
    (`python bench/kernels.py`): one warp per 16-wide value slice at every batch beat BV 32 / 2 warps and BV 8; the
    pipelined token loop wins except for single tokens up to 16 sequences."""
    return 16, 1, max_tokens > 1 or num_seqs > 16


def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets, num_drafts,
                     positions, max_seqlen: int, *, replay_only: bool = False,
                     max_replays: int | None = None) -> torch.Tensor:
    args = (q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets, num_drafts, positions,
            max_seqlen)
    if q.is_cuda:
        from .fused_recurrent import gated_delta_rule_triton
        return gated_delta_rule_triton(*args, replay_only=replay_only, max_replays=max_replays)
    return gated_delta_rule_ref(*args, replay_only=replay_only)


def gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets,
                             num_drafts, positions, max_seqlen: int, cu_seqlens_host=None,
                             one_sequence: bool = False) -> torch.Tensor:
    """For steps whose num_drafts are all 0 (the caller knows it on the host). `cu_seqlens_host`: cu_seqlens
    as a host array, when the caller has it (spares fla-core a read-back per call). `one_sequence`: the step has
    one sequence, padding rows after it (a prefill bucket): no host offsets needed, and CUDA graphs capture it."""
    args = (q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets, num_drafts, positions,
            max_seqlen)
    if q.is_cuda:
        from .chunk import chunk_gated_delta_rule_fla, chunk_gated_delta_rule_one_fla, fla_chunk_kernel
        if fla_chunk_kernel() is not None:
            gated_delta_rule(*args, replay_only=True)   # fla starts from state[slot]: fold last step's drafts in
            if one_sequence:
                return chunk_gated_delta_rule_one_fla(*args)
            return chunk_gated_delta_rule_fla(*args, cu_seqlens_host=cu_seqlens_host)
    return gated_delta_rule(*args)


def gated_delta_rule_lanes(q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets,
                           num_drafts, positions, max_seqlen: int, chunk_lanes: torch.Tensor) -> torch.Tensor:
    """`chunk_lanes` [N, 4] int32 (sequence, first row, end row, slot): sequences with no drafts and nothing to
    replay, run chunked; the recurrent kernel leaves them alone and runs the others. Same results as
    `gated_delta_rule` over the whole batch, up to the chunked kernel's rounding."""
    args = (q, k, v, a, b, A_log, dt_bias, state, pending, cu_seqlens, slots, read_offsets, num_drafts, positions,
            max_seqlen)
    if q.is_cuda:
        from .chunk import chunk_lanes_fla, fla_chunk_kernel
        from .fused_recurrent import gated_delta_rule_triton
        if fla_chunk_kernel() is not None:
            out = gated_delta_rule_triton(*args, skip=chunk_lanes)                       # [T, HV, V]
            lanes, live = chunk_lanes_fla(q, k, v, a, b, A_log, dt_bias, state, chunk_lanes[:, 1],
                                          chunk_lanes[:, 2], chunk_lanes[:, 3])        # [N, T, HV, V], [N, T]
            for n in range(lanes.shape[0]):
                out = torch.where(live[n, :, None, None], lanes[n], out)
            return out
    return gated_delta_rule(*args)


__all__ = ["gated_delta_rule", "gated_delta_rule_lanes", "gated_delta_rule_prefill", "gated_delta_rule_ref",
           "gdn_gating", "l2norm", "launch_config"]
