"""Device steps on the drafter's side (drafter.proto, DeviceStep): the step's rows are read from the buffers the
verifier registered, after its event on this process's stream; the drafts go back into "drafts", followed by
that buffer's event. The drafter itself is an in-process one that drafts on the device (DraftsOnDevice).

A step's schedule comes whole or as the changes from the stream's last device step (specdec/drafting/
device_schedule.py); DeviceSteps holds that last one. Checked before anything is applied (a malformed message is
refused whole): the repeated fields agree in length, the changes fit the schedule held, the rows fit the
registered buffers, the hidden rows match them, no more drafts than the drafter's k.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafting import (DeviceDrafts, DeviceDraftStep, DeviceSchedule, DrafterInfo, DraftsOnDevice, PrefixBlocks,
                              ScheduleChanges, apply_changes)
from specdec.rpc.v1 import drafter_pb2 as pb

from .stream_buffers import StreamBuffers


class DeviceSteps:
    """One stream's device steps: `problem` decodes and checks one, `run` runs the step just checked and keeps
    its schedule as the base of the next device step (steps of the other kind in between change nothing)."""

    def __init__(self, buffers: StreamBuffers):
        self.buffers = buffers
        self.held: DeviceSchedule | None = None    # the last device step's schedule
        self.hidden: pb.TensorRef | None = None    # the last whole step's hidden rows
        self._checked: tuple[int, DeviceSchedule, pb.TensorRef] | None = None

    def problem(self, step: pb.StepInput, info: DrafterInfo) -> str:
        """What is wrong with a device step ("" if nothing), naming the field."""
        self._checked = None
        if step.seqs:
            return "a device step carries its rows in the buffers, not in seqs"
        try:
            schedule = read_schedule(step.device, self.held)
        except ValueError as e:
            return f"device: {e}"
        hidden = step.hidden if step.HasField("hidden") else None
        if hidden is None and step.device.changes_only and self.hidden is not None:
            hidden = pb.TensorRef(transport=self.hidden.transport, dtype=self.hidden.dtype, buffer="hidden",
                                  shape=[int(schedule.chunk_lens.sum()), info.facts.hidden_size])
        problem = device_step_problem(schedule, hidden, info, self.buffers, step.prefixes)
        if not problem:
            self._checked = (step.step, schedule, hidden)
        return problem

    def run(self, drafter: DraftsOnDevice, step: pb.StepInput, device: torch.device) -> DeviceDrafts:
        """Draft for the device step `problem` just passed, and write the drafts back (no host read of any device
        value)."""
        number, schedule, hidden = self._checked
        assert number == step.step, "run() takes the step problem() checked last"
        self.held, self.hidden, self._checked = schedule, hidden, None
        return run_device_step(drafter, step.step, schedule, hidden, self.buffers, device, prefixes_of(step))


def read_schedule(d: pb.DeviceStep, held: DeviceSchedule | None) -> DeviceSchedule:
    """The schedule a DeviceStep message gives, whole or as changes from `held` (ValueError naming the field)."""
    b = len(d.seq_ids)
    for name in ("start_pos", "max_shift", "chunk_lens", "num_drafts"):
        if len(getattr(d, name)) != b:
            raise ValueError(f"{name} has {len(getattr(d, name))} values for {b} sequences")
    if b and max(d.seq_ids) >= 1 << 63:
        raise ValueError("seq_ids: ids of 2^63 and above are not taken")
    given = DeviceSchedule.of(d.seq_ids, d.start_pos, d.max_shift, d.chunk_lens, d.num_drafts)
    if not d.changes_only:
        if d.removed or d.placed:
            raise ValueError("removed or placed is set in a step sent whole (changes_only is not)")
        return given
    return apply_changes(held, ScheduleChanges(np.asarray(d.removed, np.int64), given,
                                               np.asarray(d.placed, np.int64)))


def device_step_problem(schedule: DeviceSchedule, hidden: pb.TensorRef | None, info: DrafterInfo,
                        buffers: StreamBuffers, prefixes=()) -> str:
    """What is wrong with a device step's decoded schedule and hidden rows ("" if nothing), naming the field."""
    b = len(schedule)
    if len(np.unique(schedule.seq_ids)) != b:
        return "device.seq_ids: a seq_id appears twice in one step"
    if not buffers.device_steps:
        return "a device step on a stream that registered no step buffers"
    arrays = buffers.arrays
    if arrays["step_tokens"].shape[0] < 2 or arrays["step_seqs"].shape[0] < 2:
        return "the step buffers registered have fewer than 2 rows (step_tokens, step_seqs: [2, n])"
    tokens, rows = arrays["step_tokens"].shape[1], int(schedule.chunk_lens.sum())
    seqs = min(arrays["step_seqs"].shape[1], arrays["drafts"].shape[0])
    if rows > tokens or b > seqs:
        return f"{b} sequences and {rows} rows do not fit the step buffers ({seqs} sequences, {tokens} rows)"
    if schedule.chunk_lens.min(initial=1) < 1:
        return "device.chunk_lens: every sequence has at least one row"
    if schedule.num_drafts.max(initial=0) > min(info.max_drafts, arrays["drafts"].shape[1]):
        return f"device.num_drafts: more than this drafter's {info.max_drafts} or the drafts buffer's width"
    problem = prefixes_problem(prefixes, dict(zip(schedule.seq_ids.tolist(),
                                                  (schedule.start_pos + schedule.max_shift + schedule.chunk_lens).tolist())))
    if problem:
        return problem
    if hidden is None or tuple(hidden.shape) != (rows, info.facts.hidden_size):
        return f"hidden: expected shape ({rows}, {info.facts.hidden_size}), one row per row of the step"
    on_gpu = arrays["step_tokens"].device.type == "cuda"   # the hidden rows' event orders every step buffer
    if hidden.buffer != "hidden" or hidden.transport != (pb.CUDA_IPC if on_gpu else pb.SHM) or (
            on_gpu and "hidden" not in buffers.events):
        return "hidden: a device step's rows come through the registered hidden buffer (and its event)"
    problem = buffers.problem(hidden)
    return f"hidden: {problem}" if problem else ""


def run_device_step(drafter: DraftsOnDevice, number: int, schedule: DeviceSchedule, hidden_ref: pb.TensorRef,
                    buffers: StreamBuffers, device: torch.device, prefixes: list[PrefixBlocks] = ()
                    ) -> DeviceDrafts:
    """Draft for a checked device step and write the drafts back (no host read of any device value)."""
    b = len(schedule)
    hidden = buffers.read(hidden_ref)           # on CUDA: this stream waits for the verifier's writes here
    tokens, seqs = buffers.arrays["step_tokens"], buffers.arrays["step_seqs"]
    out = drafter.draft_on_device(DeviceDraftStep(
        step=number, seq_ids=schedule.seq_ids.tolist(), start_pos=schedule.start_pos,
        max_shift=schedule.max_shift, chunk_lens=schedule.chunk_lens, num_drafts=schedule.num_drafts,
        input_ids=tokens[0].to(device), positions=tokens[1].to(device), hidden=hidden.to(device),
        committed=seqs[0, :b].to(device), next_token=seqs[1, :b].to(device), prefixes=list(prefixes)))
    drafts = buffers.arrays["drafts"]
    k = min(drafts.shape[1], out.tokens.shape[1])
    drafts[:b, :k].copy_(out.tokens[:, :k])
    if "drafts" in buffers.events:   # the verifier's stream waits on it before reading them
        buffers.events["drafts"].record(torch.cuda.current_stream(drafts.device))
    return out


def prefixes_of(step: pb.StepInput) -> list[PrefixBlocks]:
    """drafter.proto's PrefixBlocks of a step as the drafter interface's."""
    return [PrefixBlocks(p.seq_id, list(p.hashes), p.block_size, p.resumed, p.checkpoint) for p in step.prefixes]


def prefixes_problem(prefixes, ends: dict[int, int]) -> str:
    """What is wrong with a step's prefix-cache messages ("" if nothing): each names a sequence of the step
    (`ends`: seq id -> the position its rows reach this step), once, with a hash per block it counts, and a
    checkpoint its rows reach."""
    seen = set()
    for p in prefixes:
        name = f"prefixes[seq_id={p.seq_id}]"
        if p.seq_id not in ends or p.seq_id in seen:
            return f"{name}: not a sequence of this step, or named twice"
        seen.add(p.seq_id)
        if p.block_size < 1 or len(p.hashes) < max(p.resumed, p.checkpoint):
            return f"{name}: block_size {p.block_size}, {len(p.hashes)} hashes for {max(p.resumed, p.checkpoint)} blocks"
        if p.checkpoint and p.checkpoint * p.block_size - 1 > ends[p.seq_id]:
            return f"{name}: checkpoint at {p.checkpoint * p.block_size - 1}, past the rows of this step"
    return ""
