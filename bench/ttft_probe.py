"""Where the time to the first token goes, in process, on a random 4B-shaped model (32 layers, bf16, graphs on):
one 128-token prompt at a time into an idle engine (as `specdec bench` at concurrency 1 sends them), plain and
with the MTP head (k = 3, forced acceptance 3.39). Per request: each engine step until the first token (host wall,
what the step ran), then one request under torch.profiler: GPU kernel time and count against wall time, and the
top host (self CPU) entries.

Run on the GPU machine: PYTHONPATH=$PWD:$PWD/bench python3 -P bench/ttft_probe.py [--out DIR] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from draft_loop_bench import random_mtp_weights
from step_bench import random_model
from torch.profiler import ProfilerActivity, profile

from specdec_tools.bench.inprocess import InprocBench
from specdec_tools.bench.profile import summarize_events
from specdec_tools.bench.workloads import Workload
from specdec.sampling_params import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_token(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[dict]]:
    """(seconds from add_request to the step that delivers the first token, each step's wall and plan)."""
    steps = []
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while True:
        running = [(len(s.token_ids) - s.num_cached, s.num_cached) for s in engine.scheduler.running]
        t0 = time.perf_counter()
        outputs = engine.step()
        steps.append({"ms": round((time.perf_counter() - t0) * 1e3, 3), "before": running})
        if any(o.request_id == rid and o.new_token_ids for o in outputs):
            return time.perf_counter() - start, steps


def finish(engine) -> None:
    while engine.has_work:
        engine.step()


def probe(bench: InprocBench, w: Workload, requests: int, device: torch.device) -> dict:
    engine = bench.build_engine(w)
    prompts = [list(range(5 + i, 5 + i + w.prompt_tokens)) for i in range(requests + 2)]
    first_token(engine, "warm", prompts[-1], w.max_tokens)
    finish(engine)
    ttfts, timelines = [], []
    for i in range(requests):
        sync(device)
        seconds, steps = first_token(engine, f"r{i}", prompts[i], w.max_tokens)
        finish(engine)
        ttfts.append(seconds * 1e3)
        timelines.append(steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    wall = time.perf_counter()
    with profile(activities=activities) as prof:
        first_token(engine, "profiled", prompts[-2], w.max_tokens)
        sync(device)
    wall = (time.perf_counter() - wall) * 1e3
    finish(engine)
    summary = summarize_events(prof.events(), 1, device.type == "cuda")
    print(f"== {w.name}: TTFT ms {[round(t, 2) for t in ttfts]} (median {statistics.median(ttfts):.2f})")
    print(f"== {w.name}: steps to the first token (ms, and each running sequence's (uncached, cached) before):")
    for steps in timelines[:2]:
        print("   ", steps)
    print(f"== {w.name}: profiled request, wall {wall:.2f} ms: "
          + json.dumps({k: v for k, v in summary.items() if k != "top"}))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    return {"workload": w.name, "ttft_ms": [round(t, 3) for t in ttfts], "ttft_ms_median": statistics.median(ttfts),
            "timelines": timelines, "profiled_wall_ms": round(wall, 3),
            "profile": {k: v for k, v in summary.items() if k != "top"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    loaded = random_model(2 if args.smoke else 32, device, smoke=args.smoke)
    loaded.mtp_weights = random_mtp_weights(loaded, device)
    bench = InprocBench(loaded, device)
    prompt = 32 if args.smoke else 128
    record = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(), "prompt_tokens": prompt,
              "probes": [probe(bench, Workload("inproc", d, 1, prompt, 16, forced_length=f), args.requests, device)
                         for d, f in (("none", None), ("mtp", 3.39))]}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "ttft_probe.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
