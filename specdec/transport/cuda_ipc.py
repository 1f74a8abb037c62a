"""CUDA IPC: share a GPU tensor's allocation and an event with another process on the same GPU.

The exporter sends the raw handles (bytes and integers, never pickles); the importer opens them with the same
torch internals that torch.multiprocessing uses. Buffers are registered once per stream; per step only
offsets travel. The exporter records the event after writing; the importer's stream waits on it before reading.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CudaIpcExport:
    device_index: int
    mem_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_tensor(t: torch.Tensor) -> CudaIpcExport:
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, _) = t.untyped_storage()._share_cuda_()
    return CudaIpcExport(device, handle, size, offset, ref_handle, ref_offset, event_handle or b"")


def import_tensor(e: CudaIpcExport, dtype: torch.dtype, shape: tuple[int, ...], device_index: int,
                  element_offset: int = 0) -> torch.Tensor:
    # Opening a handle needs an initialised CUDA context: in a process that has not touched the GPU yet,
    # _new_shared_cuda dereferences uninitialised state and the process dies with SIGSEGV (torch's own
    # multiprocessing reductions initialise first, as here).
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index, e.mem_handle, e.storage_size_bytes, e.storage_offset_bytes, e.ref_counter_handle,
        e.ref_counter_offset, e.event_handle or b"", False)
    out = torch.empty(0, dtype=dtype, device=f"cuda:{device_index}")
    return out.set_(storage, element_offset, shape)


def visible_device_index(uuid: str) -> int | None:
    """This process's index of the GPU `uuid`, None if it cannot see that GPU (CUDA_VISIBLE_DEVICES, another host).
    A GPU visible here may be another than the one this process computes on: a tensor mapped from it is read
    there and copied over (peer-to-peer across NVLink or PCIe where the GPUs allow it)."""
    if not uuid or not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid), None)


def find_device_by_uuid(uuid: str) -> int:
    index = visible_device_index(uuid)
    if index is None:
        raise RuntimeError(f"GPU {uuid} is not visible to this process (CUDA IPC needs a GPU it can see)")
    return index

