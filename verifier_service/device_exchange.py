"""The verifier's buffers for device steps with a drafter service (drafter.proto, DeviceStep): registered once per
stream, then written and read with no host copy of their contents.

A step the verifier has not read yet goes to the drafter as its rows on the device: the verifier copies the
step's tokens, positions, committed counts and next tokens into "step_tokens" [2, max_tokens] and "step_seqs"
[2, max_seqs] (int64), and its hidden rows through the hidden buffer, whose interprocess event it records
after all of them (hidden_sender.py), then sends the schedule. The drafter's stream waits on that event, drafts,
writes "drafts" [max_seqs, K] and records the "drafts" event, then answers; the verifier's stream waits on that
event before the next step reads the drafts. So neither host waits for the other's GPU work: only the answer
(sent as soon as the drafter queued its work) crosses between them. On a CPU the same buffers are shared-memory
files and the answer itself orders the two sides.

Reuse is safe with one step in flight: the verifier writes the next step's rows after its stream waited on the
drafts event (the drafter had read them), and the drafter writes the next drafts after its stream waited on the
verifier's next event (the verifier had copied them out).
"""
from __future__ import annotations

import torch

from specdec.drafting import DeviceDraftStep
from specdec.transport.shm_buffer import ShmBuffer

from .hidden_sender import cuda_buffer


class DeviceExchange:
    def __init__(self, transport: str, max_tokens: int, max_seqs: int, max_drafts: int, device: torch.device):
        if transport not in ("shm", "cuda_ipc"):
            raise ValueError(f"device steps need the drafter on this host (shm or cuda_ipc), not {transport}")
        self.transport, self.max_tokens, self.max_seqs = transport, max_tokens, max_seqs
        shapes = {"step_tokens": (2, max_tokens), "step_seqs": (2, max_seqs), "drafts": (max_seqs, max_drafts)}
        self.shm: dict[str, ShmBuffer] = {}
        self.arrays: dict[str, torch.Tensor] = {}
        self.drafts_written: torch.cuda.Event | None = None
        for name, shape in shapes.items():
            if transport == "cuda_ipc":
                self.arrays[name] = torch.zeros(shape, dtype=torch.int64, device=device)
            else:
                self.shm[name] = ShmBuffer.create(8 * shape[0] * shape[1])
                self.arrays[name] = self.shm[name].view(0, torch.int64, shape)
        if transport == "cuda_ipc":
            self.drafts_written = torch.cuda.Event(interprocess=True)

    def setup(self) -> list[dict]:
        """The buffers to register (SharedBuffer fields); the drafter records "drafts"'s event."""
        if self.transport == "cuda_ipc":
            return [cuda_buffer(name, t, self.drafts_written if name == "drafts" else None)
                    for name, t in self.arrays.items()]
        return [dict(name=name, transport="shm", shm_path=str(self.shm[name].path),
                     size_bytes=self.shm[name].size_bytes, dtype="int64", shape=list(self.arrays[name].shape))
                for name in self.arrays]

    def fits(self, step: DeviceDraftStep) -> str:
        """Why `step` does not fit the buffers ("" if it does)."""
        if step.num_tokens > self.max_tokens or len(step.seq_ids) > self.max_seqs:
            return (f"a step of {len(step.seq_ids)} sequences and {step.num_tokens} rows is larger than the "
                    f"exchange buffers ({self.max_seqs}, {self.max_tokens})")
        return ""

    def write(self, step: DeviceDraftStep) -> None:
        """Copy the step's rows in (queued on the current stream; the hidden rows' event follows them)."""
        t, b = step.num_tokens, len(step.seq_ids)
        tokens, seqs = self.arrays["step_tokens"], self.arrays["step_seqs"]
        tokens[0, :t].copy_(step.input_ids[:t])
        tokens[1, :t].copy_(step.positions[:t])
        seqs[0, :b].copy_(step.committed)
        seqs[1, :b].copy_(step.next_token)

    def drafts(self, num_seqs: int) -> torch.Tensor:
        """[num_seqs, K] the drafter's answer, once it answered: the current stream waits for its writes."""
        if self.drafts_written is not None:
            torch.cuda.current_stream(self.arrays["drafts"].device).wait_event(self.drafts_written)
        return self.arrays["drafts"][:num_seqs]

    def unlink(self) -> None:
        """The drafter mapped the shared-memory files: remove their names (both mappings stay; shm_buffer.py)."""
        for buffer in self.shm.values():
            buffer.unlink()

    def close(self) -> None:
        for buffer in self.shm.values():
            buffer.close()


