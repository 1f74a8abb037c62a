"""Memory of a process: GPU memory per process id (nvidia-smi) and resident memory (Linux /proc), in MiB."""
from __future__ import annotations

import resource
import shutil
import subprocess
from pathlib import Path


def gpu_memory_by_pid() -> dict[int, float]:
    """MiB of GPU memory each process uses, over all GPUs, as nvidia-smi reports it ({} without nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    usage = {}
    for line in out.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            usage[int(pid)] = usage.get(int(pid), 0.0) + float(mib)   # (a line per GPU the process holds)
    return usage


def rss_mib(pid: int | str = "self") -> float | None:
    """Resident memory of a process (VmRSS), None where /proc has no such process."""
    status = Path(f"/proc/{pid}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_rss_mib() -> float:
    """This process's resident memory now, or its peak where /proc is missing."""
    now = rss_mib()
    return now if now is not None else round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class PeakMemory:
    """Memory a workload adds: on a GPU, the allocation peak above what was allocated when the window opened;
    on a CPU, the process's resident memory when it closes."""

    def __init__(self, device):
        import torch
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self.base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def close(self) -> dict:
        if self.cuda:
            peak = self.torch.cuda.max_memory_allocated(self.device) - self.base
            return {"workload_peak_mib": round(peak / 2**20, 1)}
        return {"process_rss_mib": cpu_rss_mib()}
