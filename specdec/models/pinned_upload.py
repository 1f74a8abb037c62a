"""Small per-step host → device uploads (drafts, sampling parameters, row indices) through pinned memory.

A copy from pageable memory makes the host wait for the device (torch's sync debug mode flags it): it would put a
second host sync into a step, in front of the kernels the host launches next. A pinned non-blocking copy is queued
behind the step's GPU work instead. Two pinned buffers alternate; before one is refilled, the copy that last read
it is waited for (long done in a running loop); a caller that uploads several arrays a step takes more buffers
(`buffers`), so that the copy waited for is still one of a step before. On a CPU the array is simply wrapped.
"""
from __future__ import annotations

import numpy as np
import torch


class PinnedUpload:
    def __init__(self, device: torch.device | str, buffers: int = 2):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * buffers   # uint8, pinned
        self.copied: list[torch.cuda.Event | None] = [None] * buffers
        self.turn = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        """The values of `array` (numeric numpy, any shape) as a tensor on the device."""
        array = np.ascontiguousarray(array)
        if not self.pinned:
            return torch.from_numpy(array).to(self.device)
        self.turn = (self.turn + 1) % len(self.buffers)
        event = self.copied[self.turn]
        if event is not None and not event.query():   # done long ago in a running loop: no synchronize call
            event.synchronize()
        buffer = self.buffers[self.turn]
        if buffer is None or buffer.numel() < array.nbytes:
            buffer = torch.empty(max(2 * array.nbytes, 4096), dtype=torch.uint8, pin_memory=True)
            self.buffers[self.turn] = buffer
        dtype = torch.from_numpy(array[:0].reshape(-1)).dtype
        host = buffer[: array.nbytes].view(dtype).view(array.shape)   # a view of the pinned buffer itself
        host.numpy()[...] = array
        out = host.to(self.device, non_blocking=True)
        event = event or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))   # the stream the copy was queued on
        self.copied[self.turn] = event
        return out
