"""A device step on the drafter's side (drafter.proto, DeviceStep): the step's rows are read from the buffers the
verifier registered, after its event on this process's stream; the drafts go back into "drafts", followed by
that buffer's event. The drafter itself is an in-process one that drafts on the device (DraftsOnDevice).

Checked before anything is applied (a malformed message is refused whole): the repeated fields agree in
length, the rows fit the registered buffers, the hidden rows match them, no more drafts than the drafter's k.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafting import DeviceDrafts, DeviceDraftStep, DrafterInfo, DraftsOnDevice
from specdec.rpc.v1 import drafter_pb2 as pb

from .stream_buffers import StreamBuffers


def device_step_problem(step: pb.StepInput, info: DrafterInfo, buffers: StreamBuffers) -> str:
    """What is wrong with a device step ("" if nothing), naming the field."""
    d = step.device
    b = len(d.seq_ids)
    for name in ("start_pos", "max_shift", "chunk_lens", "num_drafts"):
        if len(getattr(d, name)) != b:
            return f"device.{name} has {len(getattr(d, name))} values for {b} sequences"
    if len(set(d.seq_ids)) != b:
        return "device.seq_ids: a seq_id appears twice in one step"
    if not buffers.device_steps:
        return "a device step on a stream that registered no step buffers"
    if step.seqs:
        return "a device step carries its rows in the buffers, not in seqs"
    arrays = buffers.arrays
    if arrays["step_tokens"].shape[0] < 2 or arrays["step_seqs"].shape[0] < 2:
        return "the step buffers registered have fewer than 2 rows (step_tokens, step_seqs: [2, n])"
    tokens, rows = arrays["step_tokens"].shape[1], sum(d.chunk_lens)
    seqs = min(arrays["step_seqs"].shape[1], arrays["drafts"].shape[0])
    if rows > tokens or b > seqs:
        return f"{b} sequences and {rows} rows do not fit the step buffers ({seqs} sequences, {tokens} rows)"
    if min(d.chunk_lens, default=1) < 1:
        return "device.chunk_lens: every sequence has at least one row"
    if max(d.num_drafts, default=0) > min(info.max_drafts, arrays["drafts"].shape[1]):
        return f"device.num_drafts: more than this drafter's {info.max_drafts} or the drafts buffer's width"
    if not step.HasField("hidden") or tuple(step.hidden.shape) != (rows, info.facts.hidden_size):
        return f"hidden: expected shape ({rows}, {info.facts.hidden_size}), one row per row of the step"
    on_gpu = arrays["step_tokens"].device.type == "cuda"   # the hidden rows' event orders every step buffer
    if step.hidden.buffer != "hidden" or step.hidden.transport != (pb.CUDA_IPC if on_gpu else pb.SHM) or (
            on_gpu and "hidden" not in buffers.events):
        return "hidden: a device step's rows come through the registered hidden buffer (and its event)"
    problem = buffers.problem(step.hidden)
    return f"hidden: {problem}" if problem else ""


def run_device_step(drafter: DraftsOnDevice, step: pb.StepInput, buffers: StreamBuffers,
                    device: torch.device) -> DeviceDrafts:
    """Draft for a checked device step and write the drafts back (no host read of any device value)."""
    d = step.device
    b = len(d.seq_ids)
    hidden = buffers.read(step.hidden)           # on CUDA: this stream waits for the verifier's writes here
    tokens, seqs = buffers.arrays["step_tokens"], buffers.arrays["step_seqs"]
    u64 = lambda values: np.fromiter(values, np.int64, count=b)   # noqa: E731
    out = drafter.draft_on_device(DeviceDraftStep(
        step=step.step, seq_ids=list(d.seq_ids), start_pos=u64(d.start_pos), max_shift=u64(d.max_shift),
        chunk_lens=u64(d.chunk_lens), num_drafts=u64(d.num_drafts), input_ids=tokens[0].to(device),
        positions=tokens[1].to(device), hidden=hidden.to(device), committed=seqs[0, :b].to(device),
        next_token=seqs[1, :b].to(device)))
    drafts = buffers.arrays["drafts"]
    k = min(drafts.shape[1], out.tokens.shape[1])
    drafts[:b, :k].copy_(out.tokens[:, :k])
    if "drafts" in buffers.events:   # the verifier's stream waits on it before reading them
        buffers.events["drafts"].record(torch.cuda.current_stream(drafts.device))
    return out
