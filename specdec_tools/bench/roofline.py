"""The two references every step is held against, measured in the same run on the same device:

- device copy bandwidth: `dst.copy_(src)` of a large buffer, counting bytes read + written;
- the bare weight-GEMM chain: one `x @ W.T` per 2-D weight of the target (every linear of every layer, then the
  lm_head), for 1 token (and k + 1 tokens), captured in ONE CUDA graph and replayed — the fastest a decode step
  that reads every weight once can be with plain cuBLAS GEMMs and no launch overhead. On a CPU the same GEMMs
  run in a plain loop.
Each figure is the median over timed repetitions after warm-up.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .traffic import round_sig


def _median_seconds(fn: Callable[[], None], device: torch.device, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 20) -> dict:
    """GB/s of a device-to-device copy, read + write bytes counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, reps)
    return {"bytes": nbytes, "seconds": seconds, "gbs": round_sig(2 * nbytes / seconds / 1e9)}


class WeightChain:
    """Random weights of the given [out, in] shapes and one output buffer each; run() does every GEMM once."""

    def __init__(self, shapes: tuple[tuple[int, int], ...], tokens: int, dtype: torch.dtype, device: torch.device):
        self.weights = [torch.empty(s, dtype=dtype, device=device).normal_(0, 0.02) for s in shapes]
        ins = {s[1] for s in shapes}
        self.inputs = {i: torch.randn(tokens, i, dtype=dtype, device=device) for i in ins}   # [T, in]
        self.outputs = [torch.empty(tokens, s[0], dtype=dtype, device=device) for s in shapes]  # [T, out]
        self.bytes = sum(w.numel() * w.element_size() for w in self.weights)

    def run(self) -> None:
        for w, y in zip(self.weights, self.outputs):
            torch.mm(self.inputs[w.shape[1]], w.t(), out=y)

    def graphed(self) -> Callable[[], None]:
        """run() captured once in a CUDA graph; the returned callable replays it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run()
        return graph.replay


def weight_chain(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype, device: torch.device,
                 tokens: tuple[int, ...] = (1, 4), reps: int = 20) -> dict:
    """Seconds of the whole chain per token count, and the weight bandwidth it reaches at 1 token."""
    out = {"num_gemms": len(shapes), "cuda_graph": device.type == "cuda", "by_tokens": {}}
    for t in tokens:
        chain = WeightChain(shapes, t, dtype, device)
        fn = chain.graphed() if device.type == "cuda" else chain.run
        seconds = _median_seconds(fn, device, reps)
        out["weight_bytes"] = chain.bytes
        out["by_tokens"][str(t)] = {"ms": round_sig(seconds * 1e3), "gbs": round_sig(chain.bytes / seconds / 1e9)}
        del chain, fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = out["by_tokens"][str(tokens[0])]
    out["ms_1_token"], out["gbs"] = first["ms"], first["gbs"]
    return out


def measure(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype, device: torch.device, k: int) -> dict:
    """Both references; small buffers on a CPU so the smoke run stays quick."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    reps = 20 if device.type == "cuda" else 5
    return {"device_copy": copy_bandwidth(device, nbytes, reps),
            "weight_chain": weight_chain(shapes, dtype, device, tokens=(1, k + 1), reps=reps)}
