"""The engine-step part of bench/profile_steps.py (its docstring's 2 and 4): engine_steps builds an in-process
engine for a workload, prefills its prompts, then times its steps (wall, the engine's phases, launch_timers' host ms
of the overlapped step's launch and read), profiles 10 more (top host and GPU entries) and counts where a step
synchronises with the device (sync_sites); parallel_engine_steps does it over tensor-parallel ranks of a make-tiny
preset's shape. Also the profiler settings the prefill part shares (ACTIVITIES, SORT, sync)."""
from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from specdec_tools.bench.inprocess import InprocBench
from specdec_tools.bench.profile import summarize_events
from specdec_tools.bench.sync_sites import site, synchronising_stacks
from specdec_tools.bench.workloads import K, Workload
from specdec.drafting.acceptance_rate import acceptance_rate_for
from specdec_tools.tiny import make_tiny
from specdec.sampling_params import SamplingParams

ACTIVITIES = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
SORT = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
FORCED_LENGTH = 3.39
# (drafter, forced mean acceptance length, synthetic drafter's per-token acceptance) of the engine steps' workloads
DRAFTERS = (("none", None, None), ("mtp", FORCED_LENGTH, None))
PARALLEL_DRAFTERS = (("none", None, None),
                     ("synthetic", FORCED_LENGTH, round(acceptance_rate_for(FORCED_LENGTH, K), 2)))
RANK_STATS_EVERY_S = 5.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_sites(engine, steps: int = 3) -> dict[str, float]:
    """Where the engine's steps synchronise with the device, per step, by call site (4 frames deep)."""
    sites = Counter(site(frames, depth=4) for frames in synchronising_stacks(engine.step, steps))
    return {where: round(n / steps, 2) for where, n in sites.most_common()}


def launch_timers(engine) -> dict[str, list[float]]:
    """Host ms of the parts of an overlapped step's launch and read (wrapped in place), per call."""
    import verifier_service.engine as engine_module
    from verifier_service.in_flight import InFlightStep
    times: dict[str, list[float]] = {}

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                times.setdefault(label, []).append((time.perf_counter() - t0) * 1e3)
        setattr(owner, name, timed)
    runner = engine.executor.runner
    wrap(engine.executor, "forward", "executor.forward")
    wrap(runner.graphs.staging if runner.graphs else runner.staging, "stage", "  staging")
    wrap(engine_module, "ChainedInputs", "chained inputs")
    wrap(engine.verifying, "verdict", "verdict (sampler)")
    wrap(engine.drafting, "ask_on_device", "drafter (asked)")
    wrap(InFlightStep, "launch", "in-flight launch (host copy)")
    wrap(engine, "_launch", "LAUNCH (all)")
    wrap(engine, "_read", "READ (all)")
    return times


def engine_steps(bench: InprocBench, w: Workload, steps: int = 30) -> dict:
    engine = bench.build_engine(w)
    try:
        return _engine_steps(engine, w, steps)
    finally:
        engine.executor.close()   # its tensor-parallel ranks, if any
        del engine                # the timers' wrappers hold it in cycles: free its weights before the next one
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _engine_steps(engine, w: Workload, steps: int) -> dict:
    prompts = [list(range(3 + i, 3 + i + w.prompt_tokens)) for i in range(w.concurrency)]
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
    while any(s.num_cached < s.num_prompt for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()
    walls, phases = [], []
    timers = launch_timers(engine)
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - t0) * 1e3)
        phases.append({k: v * 1e3 for k, v in engine.last_step_seconds.items()})
    with profile(activities=ACTIVITIES) as prof:
        for _ in range(10):
            engine.step()
        sync()
    syncs = sync_sites(engine) if torch.cuda.is_available() else {}
    mean_phase = {k: round(statistics.mean(p.get(k, 0.0) for p in phases), 3) for k in phases[0]}
    print(f"== {w.name}: host syncs per step by site: {json.dumps(syncs, indent=1)}")
    print(f"== {w.name}: {statistics.median(walls):.2f} ms per step (median of {steps}); phases {mean_phase}")
    launch = {k: round(statistics.median(v), 3) for k, v in timers.items()}
    print(f"== {w.name}: host ms per call (median): {json.dumps(launch, indent=1)}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
    print(prof.key_averages().table(sort_by=SORT, row_limit=12, max_name_column_width=70))
    summary = summarize_events(prof.events(), 10, torch.cuda.is_available())
    print(json.dumps({k: v for k, v in summary.items() if k != "top"}))
    for i in range(len(prompts)):
        engine.abort(f"p{i}")
    return {"workload": w.name, "forced_acceptance_length": w.forced_length,
            "median_step_ms": round(statistics.median(walls), 3), "phases_ms": mean_phase,
            "launch_parts_ms": launch,
            "sync_sites_per_step": syncs,
            **{k: v for k, v in summary.items() if k != "top"}}


def workloads(concurrency: list[int], drafters, smoke: bool) -> list[Workload]:
    return [Workload("inproc", d, c, 32 if smoke else 128, 200, forced_length=f, accept_rate=a)
            for c in concurrency for d, f, a in drafters]


def parallel_engine_steps(preset: str, layers: int, num_ranks: int, concurrency: list[int], device: torch.device,
                          smoke: bool, all_reduce: str = "one-shot") -> list[dict]:
    """engine_steps of `preset`'s shape over `num_ranks` tensor-parallel ranks, each making its shard's random weights
    on its device (`--load-format dummy`), bf16 (fp32 on the CPU)."""
    with tempfile.TemporaryDirectory(prefix=f"specdec-{preset}-") as folder:
        make_tiny(folder, preset=preset, overrides={"num_hidden_layers": layers}, weights=False, dtype="bfloat16")
        bench = InprocBench(None, device, target=dict(
            model_dir=folder, dtype="float32" if smoke else "bfloat16", load_format="dummy",
            tensor_parallel_size=num_ranks, rank_stats_every_s=RANK_STATS_EVERY_S, all_reduce=all_reduce))
        return [engine_steps(bench, w) for w in workloads(concurrency, PARALLEL_DRAFTERS, smoke)]
