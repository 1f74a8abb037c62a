"""What a process may give its caches on a GPU (`--gpu-memory-utilization`).

    caches = utilization x device memory - held - activations - OUTSIDE_ALLOCATOR,  at most free - activations

`held`: what torch's allocator holds for this process once its weights are loaded (no temporaries);
`activations`: the peak its steps add above that, measured by the caller; OUTSIDE_ALLOCATOR: what the process uses
that the allocator does not see (the CUDA context, cuBLAS / Triton workspaces, NCCL buffers). The share is the
process's own, so two processes on one GPU (a verifier at 0.9 and a drafter at 0.05) size themselves alike in
either start order, as long as each stays inside its share (what the caller counts as activations must cover its
peaks); where other processes hold more than their share, what is free bounds it instead (and the
log says so).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30
OUTSIDE_ALLOCATOR = GIB


@dataclass(frozen=True)
class DeviceMemory:
    total: int   # bytes of the device
    free: int    # bytes free on the device now (every process counted)
    held: int    # bytes torch's allocator holds for this process now

    @staticmethod
    def read(device: torch.device | str) -> "DeviceMemory":
        device = torch.device(device)
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total=total, free=free, held=torch.cuda.memory_allocated(device))

    def cache_bytes(self, utilization: float, activations: int) -> tuple[int, str]:
        """(bytes the caches may take, what bounded them: "utilization" or "free memory")."""
        if not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        share = int(self.total * utilization) - self.held - activations - OUTSIDE_ALLOCATOR
        free = self.free - activations - OUTSIDE_ALLOCATOR
        return (max(0, share), "utilization") if share <= free else (max(0, free), "free memory")

    def describe(self, utilization: float) -> str:
        return (f"{utilization:.0%} of {self.total / GIB:.1f} GiB, {self.held / GIB:.2f} GiB held by weights and "
                f"buffers, {self.free / GIB:.1f} GiB free on the device")
