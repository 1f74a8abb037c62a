"""The service split per engine step, from `specdec bench --trace-steps DIR` files: for each gateway / colocated
pair of the same drafter, the verifier's step times (forward.begin to the next) at one batch size after serving
began, their median, mean and tail, the time in long steps (over --long-ms: steps with prompt chunks, stalls),
and the gateway's excess over the colocated drafter. tok/s at batch 16 moves by several percent from pass to
pass (a 256-token pass lasts under a second); the median step is the steady-state cost of the split.

    python3 bench/step_split.py DIR [--batch 16] [--long-ms 10]
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
from itertools import pairwise

from specdec.step_trace import read_marks
from specdec.trace_report import served


def step_times(path: str, batch: int) -> list[float]:
    """ms from each traced verifier step of `batch` sequences to the next step (gaps over 50 ms dropped: idle)."""
    begins = [m for m in served(read_marks([path])) if m["event"] == "forward.begin" and m["process"] == "verifier"]
    return [(b["t"] - a["t"]) * 1e3 for a, b in pairwise(begins) if a["batch"] == batch and b["t"] - a["t"] < 0.05]


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


if __name__ == "__main__":
    main()
