"""Where a bench ran: device, software versions, the code's commit."""
from __future__ import annotations

import importlib.metadata
import platform
import re
import subprocess
from pathlib import Path

import torch


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"kind": "cuda", "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    return {"kind": "cpu", "name": _cpu_name(), "threads": torch.get_num_threads()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def device_tag(info: dict) -> str:
    """Short name for file names: h100, h200, cpu ..."""
    if info["kind"] == "cpu":
        return "cpu"
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", info["name"])
    return m.group(1).lower() if m else "cuda"


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "triton", "grpcio", "protobuf", "fla-core"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def git_commit(where: Path) -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


# dense bf16 tensor-core peaks (TFLOP/s, without sparsity) of the GPUs the bench meets: MFU's denominator
DENSE_BF16_TFLOPS = {"h100": 989.0, "h200": 989.0, "h100-pcie": 756.0, "a100": 312.0}


def peak_flops(info: dict) -> float | None:
    """The device's dense bf16 peak in FLOP/s, None where it is not in DENSE_BF16_TFLOPS (the CPU)."""
    if info.get("kind") != "cuda":
        return None
    tag = device_tag(info) + ("-pcie" if "PCIe" in info.get("name", "") else "")
    tflops = DENSE_BF16_TFLOPS.get(tag)
    return tflops * 1e12 if tflops else None
