"""The service split per engine step, from `specdec bench --trace-steps DIR` files: for each gateway / colocated
pair of the same drafter, the verifier's step times (forward.begin to the next) at one batch size after serving
began, their median, mean and tail, the time in long steps (over --long-ms: steps with prompt chunks, stalls),
and the gateway's excess over the colocated drafter; then the passes' starts (--start-steps steps from the first
after an idle gap, in passes that reach the batch): the new prompts' steps, which run eagerly. tok/s at batch 16
moves by several percent from pass to pass; the median step is the steady-state cost of the split.

    python3 bench/step_split.py DIR [--batch 16] [--long-ms 10] [--start-steps 6]
"""
from __future__ import annotations

import argparse
import bisect
import glob
import os
import statistics
from itertools import pairwise

from specdec.step_trace import read_marks
from specdec_tools.trace_report import served


def step_times(path: str, batch: int) -> list[float]:
    """ms from each traced verifier step of `batch` sequences to the next step (gaps over 50 ms dropped: idle)."""
    begins = [m for m in served(read_marks([path])) if m["event"] == "forward.begin" and m["process"] == "verifier"]
    return [(b["t"] - a["t"]) * 1e3 for a, b in pairwise(begins) if a["batch"] == batch and b["t"] - a["t"] < 0.05]


def pass_starts(path: str, batch: int, num_steps: int, idle_s: float = 0.02) -> list[float]:
    """ms of the first `num_steps` engine steps of each pass that reaches `batch` sequences (a pass starts at a
    step that begins over idle_s after the last step ended; the first pass after serving began, the bench's
    warm-up pass, has no step before it and is left out)."""
    marks = [m for m in served(read_marks([path])) if m["process"] == "verifier"]
    begins = [m for m in marks if m["event"] == "step.begin"]
    ends = [m["t"] for m in marks if m["event"] == "step.end"]                           # in time order
    last_end = [bisect.bisect_left(ends, b["t"]) - 1 for b in begins]                   # -1: none before it
    starts = [i for i, (b, e) in enumerate(zip(begins, last_end)) if i > 0 and e >= 0 and b["t"] - ends[e] > idle_s]
    batches = [m for m in marks if m["event"] == "forward.begin"]
    out = []
    for i in starts:
        if i + num_steps < len(begins):
            t0, t1 = begins[i]["t"], begins[i + num_steps]["t"]
            if any(m["batch"] == batch for m in batches if t0 <= m["t"] < t1):
                out.append((t1 - t0) * 1e3)
    return out


def summary(times: list[float], long_ms: float) -> dict:
    ordered = sorted(times)
    return {"steps": len(times), "median": statistics.median(times), "mean": statistics.fmean(times),
            "p99": ordered[int(0.99 * (len(ordered) - 1))], "long_steps": sum(t > long_ms for t in times),
            "long_ms_total": sum(t for t in times if t > long_ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--long-ms", type=float, default=10.0)
    p.add_argument("--start-steps", type=int, default=6, help="steps counted from each pass's start")
    args = p.parse_args()
    for gateway in sorted(glob.glob(os.path.join(args.dir, "gateway-*-verifier.jsonl"))):
        colocated = gateway.replace("gateway-", "colocated-", 1)
        if not os.path.exists(colocated):
            continue
        label = os.path.basename(gateway)[len("gateway-"):-len("-verifier.jsonl")]
        g, c = (summary(step_times(f, args.batch), args.long_ms) for f in (gateway, colocated))
        print(f"{label} at batch {args.batch}:")
        for name, s in (("gateway", g), ("colocated", c)):
            print(f"  {name:<10} {s['steps']:>5} steps  median {s['median']:.3f}  mean {s['mean']:.3f}  "
                  f"p99 {s['p99']:.2f} ms  over {args.long_ms:g} ms: {s['long_steps']} steps, {s['long_ms_total']:.0f} ms")
        print(f"  split: median step {100 * (g['median'] / c['median'] - 1):+.1f}%, "
              f"mean step {100 * (g['mean'] / c['mean'] - 1):+.1f}%")
        starts = [pass_starts(f, args.batch, args.start_steps) for f in (gateway, colocated)]
        if all(starts):
            (gs, cs) = (statistics.median(x) for x in starts)
            print(f"  pass starts ({args.start_steps} steps, median of {len(starts[0])} / {len(starts[1])}): "
                  f"gateway {gs:.1f} ms, colocated {cs:.1f} ms, {gs - cs:+.1f} ms a pass")


if __name__ == "__main__":
    main()
