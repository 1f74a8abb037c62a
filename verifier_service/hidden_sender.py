"""Verifier side of the hidden-state transports: registers buffers once per drafter stream, then places each
step's hidden rows (offsets only for "shm" / "cuda_ipc", bytes for "inline"). It returns plain field dicts
named as in drafter.proto's SharedBuffer / TensorRef; the drafter client turns them into messages."""
from __future__ import annotations

import torch

from specdec.transport import cuda_ipc, tensor_bytes
from specdec.transport.shm_buffer import ShmBuffer


def offered_transports(device: torch.device, override: str) -> list[str]:
    if override != "auto":
        return [override]
    return ["cuda_ipc", "inline"] if device.type == "cuda" else ["shm", "inline"]


def cuda_buffer(name: str, t: torch.Tensor, event: torch.cuda.Event | None = None) -> dict:
    e = cuda_ipc.export_tensor(t)
    with torch.cuda.device(t.device):   # an unrecorded event is made on the current GPU: this thread's may be another
        event_handle = event.ipc_handle() if event is not None else b""
    return dict(
        name=name, transport="cuda_ipc", size_bytes=t.numel() * t.element_size(),
        dtype=tensor_bytes.DTYPE_NAMES[t.dtype], shape=list(t.shape), cuda_mem_handle=e.mem_handle,
        cuda_storage_size_bytes=e.storage_size_bytes, cuda_storage_offset_bytes=e.storage_offset_bytes,
        cuda_ref_counter_handle=e.ref_counter_handle, cuda_ref_counter_offset=e.ref_counter_offset,
        cuda_event_handle=event_handle, gpu_uuid=cuda_ipc.gpu_uuid(t.device))


class HiddenSender:
    def __init__(self, transport: str, max_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.transport, self.dtype = transport, dtype
        self.shm: ShmBuffer | None = None
        self.gpu: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        if transport == "shm":
            self.shm = ShmBuffer.create(max_rows * hidden_size * torch.empty((), dtype=dtype).element_size())
        elif transport == "cuda_ipc":
            self.gpu = torch.empty(max_rows, hidden_size, dtype=dtype, device=device)  # [max_rows, H]
            self.event = torch.cuda.Event(interprocess=True)

    def setup(self, shared_weights: dict[str, torch.Tensor]) -> list[dict]:
        """Buffers to register on a new stream: the hidden buffer, and target weights the drafter maps."""
        buffers = []
        if self.shm is not None:
            buffers.append(dict(name="hidden", transport="shm", shm_path=str(self.shm.path),
                                size_bytes=self.shm.size_bytes, dtype=tensor_bytes.DTYPE_NAMES[self.dtype]))
        if self.gpu is not None:
            buffers.append(cuda_buffer("hidden", self.gpu, self.event))
            buffers += [cuda_buffer(name, w) for name, w in shared_weights.items()]
        return buffers

    def send(self, rows: torch.Tensor) -> dict:
        """rows [n, H] → where the drafter reads them once this step's message arrives (TensorRef fields)."""
        ref = dict(transport=self.transport, shape=list(rows.shape), dtype=tensor_bytes.DTYPE_NAMES[self.dtype])
        if self.transport == "inline":
            ref["data"] = tensor_bytes.to_bytes(rows.to(self.dtype))
        elif self.transport == "shm":
            self.shm.view(0, self.dtype, tuple(rows.shape)).copy_(rows)
            ref["buffer"] = "hidden"
        else:
            self.gpu[: rows.shape[0]].copy_(rows)
            self.event.record()
            ref["buffer"] = "hidden"
        return ref

    def unlink(self) -> None:
        """The drafter mapped the shared-memory file: remove its name (both mappings stay; shm_buffer.py)."""
        if self.shm is not None:
            self.shm.unlink()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
