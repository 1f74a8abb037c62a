"""Timing helpers for the GPU benchmarks: per-call milliseconds from CUDA graphs (no launch overhead) or
eager launches, the device-copy bandwidth they are compared with, and the closing table."""
from __future__ import annotations

import time
from typing import Callable

import torch

REPS_CAP = 1 << 30   # set_quick() lowers it: smoke runs check the script, not the speed


def set_quick() -> None:
    global REPS_CAP
    REPS_CAP = 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 20, warmup: int = 2,
            graph: bool = True) -> tuple[float, str]:
    """(milliseconds per call, "graph" | "eager"). On CUDA with `graph`, `reps` calls are captured in one CUDA
    graph and replayed (what a captured step pays); if capture fails (a host sync inside), eager launches. Pass
    graph=False for what cannot be captured: a failed capture can leave the CUDA generator in capture mode (torch
    2.11: every later torch.randn on the device raised "Offset increment outside graph capture")."""
    reps, warmup = min(reps, REPS_CAP), min(warmup, REPS_CAP)
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps, "eager"
    mode = "eager"
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    fn()
            run, mode = g.replay, "graph"
        except Exception:  # noqa: BLE001 - not capturable (e.g. a host sync): time it eagerly
            torch.cuda.synchronize()
    if mode == "eager":
        def run():
            for _ in range(reps):
                fn()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps, mode


def copy_bandwidth(device: torch.device, size_bytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write (the roofline)."""
    if device.type != "cuda":
        size_bytes = 1 << 26
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), device, reps=10, graph=False)
    return 2 * size_bytes / (ms * 1e-3)


def row(section: str, case: str, impl: str, ms: float | None, mode: str = "", bytes_moved: int | None = None,
        copy_bw: float | None = None, **extra) -> dict:
    r = {"section": section, "case": case, "impl": impl, "ms": ms, "mode": mode}
    if bytes_moved is not None and ms:
        r["bytes"] = bytes_moved
        r["GB/s"] = bytes_moved / (ms * 1e-3) / 1e9
        if copy_bw:
            r["roofline"] = bytes_moved / (ms * 1e-3) / copy_bw
    return r | extra


def table(rows: list[dict]) -> str:
    cols = ["section", "case", "impl", "ms", "mode", "GB/s", "roofline", "note"]
    fmt = {"ms": "{:.4f}", "GB/s": "{:.0f}", "roofline": "{:.2f}"}
    cells = [[(fmt.get(c, "{}").format(r[c]) if r.get(c) is not None else "") for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)
