"""Tensors as raw row-major bytes with a dtype name: the INLINE transport. Nothing is ever unpickled."""
from __future__ import annotations

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int64: "int64"}   # (int64: the device steps' token buffers)
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    if name not in NAME_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {', '.join(NAME_DTYPES)}")
    return NAME_DTYPES[name]


def to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(data) != expected:
        raise ValueError(f"inline tensor has {len(data)} bytes, shape {tuple(shape)} of {dtype} needs {expected}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
