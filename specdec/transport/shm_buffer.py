"""A shared-memory file on this host, mapped as a tensor by two processes: the SHM transport (CPU).

The verifier creates the file once and writes hidden states into it; the drafter maps the same file by path.
A writer never overwrites a region before the reader has answered the step that used it (one step in flight).
"""
from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch


def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class ShmBuffer:
    def __init__(self, path: Path, size_bytes: int, owner: bool):
        self.path, self.size_bytes, self.owner = Path(path), size_bytes, owner
        self.bytes = torch.from_file(str(path), shared=True, size=size_bytes, dtype=torch.uint8)  # [size]

    @staticmethod
    def create(size_bytes: int, prefix: str = "specdec") -> "ShmBuffer":
        path = _shm_dir() / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(size_bytes)
        return ShmBuffer(path, size_bytes, owner=True)

    @staticmethod
    def attach(path: str, size_bytes: int) -> "ShmBuffer":
        p = Path(path)
        if not p.is_file() or p.stat().st_size < size_bytes:
            raise FileNotFoundError(f"shared-memory file {path} is missing or smaller than {size_bytes} bytes "
                                    "(SHM needs both processes on the same host, sharing /dev/shm)")
        return ShmBuffer(p, size_bytes, owner=False)

    def view(self, offset_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset_bytes + n > self.size_bytes:
            raise ValueError(f"shm region [{offset_bytes}, {offset_bytes + n}) is past the buffer ({self.size_bytes})")
        return self.bytes[offset_bytes:offset_bytes + n].view(dtype).view(shape)

    def close(self) -> None:
        if self.owner:
            self.path.unlink(missing_ok=True)
