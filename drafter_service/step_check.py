"""Checks a verifier's step message before the drafter applies any of it, so that a malformed message is
refused whole and no sequence's drafter state changes (releases included)."""
from __future__ import annotations

from specdec.drafting import DrafterInfo
from specdec.rpc.v1 import drafter_pb2 as pb

from .device_step import DeviceSteps, prefixes_problem
from .stream_buffers import StreamBuffers


def step_problem(step: pb.StepInput, last_step: int, info: DrafterInfo, buffers: StreamBuffers,
                 device_steps: DeviceSteps | None = None) -> str:
    """What is wrong with `step` ("" if nothing), naming the field. `device_steps`: the stream's, when this
    drafter takes device steps."""
    if step.step <= last_step:
        return f"step {step.step} is not after the previous step {last_step} (replayed or out of order)"
    if step.HasField("device"):
        return device_steps.problem(step, info) if device_steps is not None else \
            "a device step, but this drafter does not take them (it did not offer device_steps)"
    seq_ids = [s.seq_id for s in step.seqs]
    if len(set(seq_ids)) != len(seq_ids):
        return "seqs: a seq_id appears twice in one step"
    problem = prefixes_problem(step.prefixes, {s.seq_id: s.start_pos + len(s.token_ids) - 1 for s in step.seqs})
    if problem:
        return problem
    vocab = info.facts.vocab_size
    for s in step.seqs:
        if not s.token_ids:
            return f"seqs[seq_id={s.seq_id}].token_ids is empty (it holds at least the newest committed token)"
        if min(s.token_ids) < 0 or (vocab and max(s.token_ids) >= vocab):
            bad = next(t for t in s.token_ids if t < 0 or (vocab and t >= vocab))
            return f"seqs[seq_id={s.seq_id}].token_ids: id {bad} is outside the drafter's vocabulary [0, {vocab})"
    if not info.needs_hidden:
        return ""
    if not step.HasField("hidden"):
        return "hidden is missing: this drafter needs the target's hidden states"
    rows = sum(len(s.token_ids) - 1 for s in step.seqs)
    if tuple(step.hidden.shape) != (rows, info.facts.hidden_size):
        return (f"hidden has shape {tuple(step.hidden.shape)}, expected ({rows}, {info.facts.hidden_size}): "
                "one row per committed token but the newest of each sequence")
    problem = buffers.problem(step.hidden)
    return f"hidden: {problem}" if problem else ""
