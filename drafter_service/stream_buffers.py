"""Buffers one verifier registered on one Step stream, and how to read a TensorRef from them.

Every reference is checked before it is read (a buffer never registered, a region past its end, a byte count
that does not match the shape): a malformed message is refused, never read out of bounds."""
from __future__ import annotations

import torch

from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.transport import cuda_ipc, tensor_bytes
from specdec.transport.shm_buffer import ShmBuffer


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


DEVICE_STEP_BUFFERS = ("step_tokens", "step_seqs", "drafts")   # int64 arrays of device steps (DeviceStep)


class StreamBuffers:
    def __init__(self):
        self.shm: dict[str, ShmBuffer] = {}
        self.cuda: dict[str, torch.Tensor] = {}     # name -> uint8 view of the shared allocation
        self.events: dict[str, torch.cuda.Event] = {}
        self.weights: dict[str, torch.Tensor] = {}  # shared target weights (CUDA IPC)
        self.arrays: dict[str, torch.Tensor] = {}   # device steps' buffers, as their int64 [rows, cols] arrays

    def register(self, setup: pb.Setup) -> None:
        """Map the buffers of a Setup message; raises ValueError / OSError naming the buffer that failed."""
        for b in setup.buffers:
            if b.name in DEVICE_STEP_BUFFERS and (b.dtype != "int64" or len(b.shape) != 2):
                raise ValueError(f"buffer {b.name!r}: expected an int64 [rows, cols] array, got {b.dtype} "
                                 f"{list(b.shape)}")
            if b.transport == pb.SHM:
                try:   # only a verifier's segment of exactly this size (shm_buffer.py: ShmBuffer.attach)
                    self.shm[b.name] = ShmBuffer.attach(b.shm_path, b.size_bytes)
                except (ValueError, OSError) as e:
                    raise ValueError(f"buffer {b.name!r}: {e}") from e
                if b.name in DEVICE_STEP_BUFFERS:
                    self.arrays[b.name] = self.shm[b.name].view(0, torch.int64, tuple(b.shape))
            elif b.transport == pb.CUDA_IPC:
                self._register_cuda(b)
            else:
                raise ValueError(f"buffer {b.name!r}: transport {b.transport} cannot be registered")

    @property
    def device_steps(self) -> bool:
        """The verifier registered the buffers of device steps."""
        return set(DEVICE_STEP_BUFFERS) <= set(self.arrays)

    def _register_cuda(self, b: pb.SharedBuffer) -> None:
        device = cuda_ipc.find_device_by_uuid(b.gpu_uuid)
        export = cuda_ipc.CudaIpcExport(device, b.cuda_mem_handle, b.cuda_storage_size_bytes,
                                        b.cuda_storage_offset_bytes, b.cuda_ref_counter_handle,
                                        b.cuda_ref_counter_offset, b"")
        dtype = tensor_bytes.dtype_from_name(b.dtype)
        shape = tuple(b.shape) if b.shape else (b.size_bytes // torch.empty((), dtype=dtype).element_size(),)
        t = cuda_ipc.import_tensor(export, dtype, shape, device)
        if b.cuda_event_handle:
            self.events[b.name] = torch.cuda.Event.from_ipc_handle(device, b.cuda_event_handle)
        if b.name == "hidden":
            self.cuda[b.name] = t.view(torch.uint8).view(-1)
        elif b.name in DEVICE_STEP_BUFFERS:
            self.arrays[b.name] = t
        else:
            self.weights[b.name] = t

    def problem(self, ref: pb.TensorRef) -> str:
        """What is wrong with `ref` ("" if it can be read)."""
        if ref.dtype not in tensor_bytes.NAME_DTYPES:
            return f"dtype {ref.dtype!r} is not one of {', '.join(tensor_bytes.NAME_DTYPES)}"
        n = _nbytes(tensor_bytes.dtype_from_name(ref.dtype), tuple(ref.shape))
        if ref.transport == pb.INLINE:
            return "" if len(ref.data) == n else f"inline data has {len(ref.data)} bytes, shape needs {n}"
        if ref.transport == pb.SHM:
            size = self.shm[ref.buffer].size_bytes if ref.buffer in self.shm else None
        elif ref.transport == pb.CUDA_IPC:
            size = self.cuda[ref.buffer].numel() if ref.buffer in self.cuda else None
        else:
            return f"transport {ref.transport} is not supported"
        if size is None:
            return f"buffer {ref.buffer!r} was never registered on this stream"
        if ref.offset_bytes + n > size:
            return (f"region [{ref.offset_bytes}, {ref.offset_bytes + n}) is past the end of buffer "
                    f"{ref.buffer!r} ({size} bytes)")
        return ""

    def read(self, ref: pb.TensorRef) -> torch.Tensor:
        """The tensor `ref` points at (check `problem(ref)` first)."""
        dtype, shape = tensor_bytes.dtype_from_name(ref.dtype), tuple(ref.shape)
        if ref.transport == pb.INLINE:
            return tensor_bytes.from_bytes(ref.data, dtype, shape)
        if ref.transport == pb.SHM:
            return self.shm[ref.buffer].view(ref.offset_bytes, dtype, shape)
        if ref.buffer in self.events:  # on the buffer's device: this gRPC thread's current device may be another
            torch.cuda.current_stream(self.cuda[ref.buffer].device).wait_event(self.events[ref.buffer])
        n = _nbytes(dtype, shape)
        return self.cuda[ref.buffer][ref.offset_bytes:ref.offset_bytes + n].view(dtype).view(shape)
