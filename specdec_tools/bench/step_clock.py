"""The inproc path's step split: where a decode step's wall time goes, from the engine's phases and clocks around
the target's forward and the drafter's calls.

Step split (the words of docs/architecture.md), mean over decode steps (those after every request has its first token):
    target_forward      executor.forward: GPU time between CUDA events around it (host time on a CPU), at least
                        its host time
    sampling            the engine's "verify" phase (rejection sampling; its one host sync waits for the
                        target's remaining GPU work, which is counted in target_forward instead)
    drafter_round_trip  the engine's "drafter" phase (in-process: the drafter call and reading its answer)
    drafter_compute     drafter.propose (draft_on_device in overlapped steps): GPU time between CUDA events
                        (host time on a CPU)
    host                step wall time - the engine's three phases (scheduling, commit, stop checks,
                        the drafter's inputs and hidden rows)
so target_forward + sampling + drafter_round_trip + host = the step's wall time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch


class CallClock:
    """Wraps a bound method; records each call's time under the current step: the longer of its host time and,
    on a GPU, the span between CUDA events around it (first kernel to last, read after the workload: no extra
    sync). A call that only works on the host (the n-gram drafter) thus counts its host time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.step = 0
        self.records: list[tuple[int, float, object, object]] = []

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            events = None
            if self.cuda:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            host = time.perf_counter() - t0
            if events:
                events[1].record()
            self.records.append((self.step, host, *(events or (None, None))))
            return out
        return timed

    def seconds_by_step(self) -> dict[int, float]:
        """Call on a CPU, or after the device is synchronised."""
        out: dict[int, float] = defaultdict(float)
        for step, host, start, end in self.records:
            out[step] += max(host, start.elapsed_time(end) / 1e3) if start is not None else host
        return out


def step_split(steps, target_gpu: dict[int, float], drafter_gpu: dict[int, float], has_drafter: bool,
               decode_from: float) -> dict:
    """Mean ms per decode step of each part (see the module docstring); steps = [(end time, wall, phases,
    overlapped)]. An overlapped step's GPU work runs behind the host's: its parts are the host's phases."""
    rows = []
    for i, (end, wall, phases, overlapped) in enumerate(steps):
        if end <= decode_from:
            continue
        th, tv, td = (phases.get(p, 0.0) for p in ("target", "verify", "drafter"))
        target = th if overlapped else max(target_gpu.get(i, th), th)
        # The target's GPU time beyond its host time was waited for in the sampling phase (its one sync), and
        # beyond that in the host phase: move it there, so the parts still add up to the wall time.
        spill = target - th
        rows.append({"total": wall, "target_forward": target, "sampling": max(0.0, tv - spill),
                     "drafter_round_trip": td, "drafter_compute": drafter_gpu.get(i, 0.0),
                     "host": max(0.0, wall - th - tv - td - max(0.0, spill - tv))})
    if not rows:
        return {"decode_steps": 0}
    out = {key: round(sum(r[key] for r in rows) / len(rows) * 1e3, 4) for key in rows[0]}
    if not has_drafter:  # the engine's drafter phase is then bookkeeping on the host: count it as host time
        out["host"] = round(out["host"] + out["drafter_round_trip"], 4)
        out["drafter_round_trip"] = out["drafter_compute"] = None
    return {"decode_steps": len(rows), **out}
