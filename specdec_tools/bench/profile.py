"""`--profile`: torch.profiler over a few decode steps of one in-process workload, summarised.

    top kernels     GPU kernels (CPU ops on a CPU) by total time per step, with calls per step and share
    launch gaps     GPU idle time between consecutive kernels per step, kernels per step, GPU busy fraction
    host syncs      CUDA runtime synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize,
                    cudaEventSynchronize, cudaMemcpy) per step; `.item()`-style reads (aten::_local_scalar_dense)
Steps start once every request has its first token, so the profile is of decoding only.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType

from specdec.sampling_params import SamplingParams

from .inprocess import InprocBench
from .workloads import Workload

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCALAR_READ = "aten::_local_scalar_dense"


def profile_workload(bench: InprocBench, w: Workload, prompts: list[list[int]], steps: int,
                     guard_s: float = 120.0) -> dict:
    engine = bench.build_engine(w)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, SamplingParams(max_tokens=w.max_tokens, temperature=w.temperature,
                                                                  seed=i, ignore_eos=True))
    started: set[str] = set()
    deadline = time.perf_counter() + guard_s
    while len(started) < len(prompts) and engine.has_work and time.perf_counter() < deadline:  # prefill first
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    cuda = bench.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    done = 0
    with torch.profiler.profile(activities=activities) as prof:
        while done < steps and engine.has_work:
            engine.step()
            done += 1
        if cuda:
            torch.cuda.synchronize(bench.device)
    for i in range(len(prompts)):
        engine.abort(f"profile-{i}")
    if done == 0:
        raise RuntimeError(f"nothing to profile: {w.name} finished during its prefill (raise --max-tokens)")
    return {"workload": w.name, "steps": done, **summarize_events(prof.events(), done, cuda)}


def summarize_events(events, steps: int, cuda: bool, top: int = 12) -> dict:
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    syncs = sum(1 for e in cpu_events if e.name in SYNC_CALLS)
    scalar_reads = sum(1 for e in cpu_events if e.name == SCALAR_READ)
    if cuda:
        timed = [(e.name, e.time_range.start, e.time_range.end) for e in kernels]
    else:  # no kernels: the CPU ops' own (self) time stands in, top-level and nested alike
        timed = [(e.name, e.time_range.start, e.time_range.start + e.self_cpu_time_total)
                 for e in cpu_events if e.name.startswith("aten::")]
    total, calls = defaultdict(float), defaultdict(int)
    for name, start, end in timed:
        total[name] += end - start
        calls[name] += 1
    grand = sum(total.values()) or 1.0
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    out = {
        "time_source": "GPU kernels" if cuda else "CPU ops (self time)",
        "top": [{"name": n[:90], "ms_per_step": round(total[n] / steps / 1e3, 4),
                 "calls_per_step": round(calls[n] / steps, 2), "share": round(total[n] / grand, 4)} for n in ranked],
        "host_syncs_per_step": round(syncs / steps, 2) if cuda else None,
        "scalar_reads_per_step": round(scalar_reads / steps, 2),
        "ops_per_step": round(len(timed) / steps, 1),
    }
    if cuda:
        out.update(launch_gaps(sorted((s, e) for _, s, e in timed), steps))
    return out


def launch_gaps(spans: list[tuple[float, float]], steps: int) -> dict:
    """Idle time between kernels (spans sorted by start, in µs): per step, median gap, busy fraction."""
    if not spans:
        return {"kernels_per_step": 0, "launch_gap_ms_per_step": None, "median_gap_us": None,
                "gpu_busy_fraction": None}
    gaps, busy, cursor = [], 0.0, spans[0][0]
    for start, end in spans:
        if start > cursor:
            gaps.append(start - cursor)
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
    window = cursor - spans[0][0]
    return {"kernels_per_step": round(len(spans) / steps, 1),
            "launch_gap_ms_per_step": round(sum(gaps) / steps / 1e3, 4),
            "median_gap_us": round(sorted(gaps)[len(gaps) // 2], 2) if gaps else 0.0,
            "gpu_busy_fraction": round(busy / window, 4) if window > 0 else None}
