"""Checks a drafter's answer before the verifier uses any of it: a drafter is another process (or another
package), so its proposals are input. A bad answer is a drafter failure for that step, never a crash."""
from __future__ import annotations

import torch

from .device_drafting import DeviceDraftStep, DeviceDrafts
from .interface import DraftInput, DraftOutput


def proposal_problem(out: DraftOutput, inputs: list[DraftInput], vocab_size: int) -> str:
    """What is wrong with `out` as the answer to `inputs` for a target of `vocab_size` ids ("" if nothing)."""
    if len(out.drafts) != len(inputs):
        return f"answered for {len(out.drafts)} sequences, asked about {len(inputs)}"
    for drafts, item in zip(out.drafts, inputs):  # one pass per sequence; min / max scan its few tokens
        if len(drafts) > item.num_drafts:
            return f"sequence {item.seq_id}: {len(drafts)} drafts, asked for at most {item.num_drafts}"
        if drafts and not (0 <= min(drafts) and max(drafts) < vocab_size):
            bad = next(t for t in drafts if not 0 <= t < vocab_size)
            return f"sequence {item.seq_id}: draft id {bad} is outside the target's vocabulary [0, {vocab_size})"
    sent_whole = {item.seq_id for item in inputs if item.start_pos == 0}
    if sent_whole & set(out.missing):  # it got all of that context this very step: recomputing would loop
        return f"sequence {min(sent_whole & set(out.missing))}: reported missing although sent from position 0"
    if out.probs is not None:
        rows = sum(len(d) for d in out.drafts)
        if tuple(out.probs.shape) != (rows, vocab_size):
            return f"probs have shape {tuple(out.probs.shape)}, expected ({rows}, {vocab_size})"
    return ""


def device_drafts_problem(out: DeviceDrafts, step: DeviceDraftStep, max_drafts: int) -> str:
    """What is wrong with a device drafter's answer, as far as the host can tell without reading the device
    ("" if nothing): its shape, dtype, device and counts (the ids themselves stay on the device)."""
    b = len(step.seq_ids)
    if len(out.counts) != b:
        return f"answered for {len(out.counts)} sequences, asked about {b}"
    if not isinstance(out.tokens, torch.Tensor) or tuple(out.tokens.shape[:1]) != (b,) or out.tokens.ndim != 2:
        shape = tuple(out.tokens.shape) if isinstance(out.tokens, torch.Tensor) else None
        return f"drafts have shape {shape}, expected ({b}, K)"
    if out.tokens.dtype != torch.int64 or out.tokens.device != step.committed.device:
        return f"drafts are {out.tokens.dtype} on {out.tokens.device}, expected torch.int64 on {step.committed.device}"
    for count, wanted, seq_id in zip(out.counts, step.num_drafts, step.seq_ids):
        if not 0 <= count <= min(int(wanted), max_drafts, out.tokens.shape[1]):
            return f"sequence {seq_id}: {count} drafts, asked for at most {min(int(wanted), max_drafts)}"
    return ""
