"""What a fresh server's first requests wait for, with and without the verifier's start-up warm-up.

For each variant the whole stack (gateway, verifier, no drafter) starts on an empty Triton cache, then
CONCURRENCY requests arrive at once (the gateway path of `specdec bench`, no bench warm-up) and run once more
after; printed: start seconds, and per run tok/s, TTFT p50 and ITL p50 / p99 / max (a Triton compile on the
critical path shows as an ITL max of a second or more). Run from the repository root on the GPU machine (not
from bench/, whose kernels.py would shadow the kernels package in the children):
    PYTHONPATH=$PWD python3 -P bench/cold_start.py --model DIR [--concurrency 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from specdec_tools.bench.gateway_clients import send_streams
from specdec_tools.bench.gateway_path import GatewayBench
from specdec_tools.bench.inprocess import blocks_for, scheduler_for
from specdec_tools.bench.latency import summarize
from specdec_tools.bench.workloads import Workload
from specdec_tools.local_stack import LocalStack, StackConfig

VARIANTS = {"no warm-up": ["--no-warm-up"], "warm-up": []}


def run_variant(args, extra: list[str]) -> dict:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")  # the children inherit it
    w = Workload("gateway", "none", args.concurrency, args.prompt_tokens, args.max_tokens)
    bench = GatewayBench(args.model, args.device, args.dtype)
    budget = scheduler_for(w, args.device.split(":")[0]).max_batched_tokens
    verifier = ["--max-running", str(w.concurrency), "--max-batched-tokens", str(budget),
                "--kv-blocks", str(blocks_for(w)), "--max-context", str(w.prompt_tokens + w.max_tokens + 1), *extra]
    config = StackConfig(model=args.model, drafter="none", device=args.device, dtype=args.dtype, port=0,
                         verifier_args=tuple(verifier), log_dir=bench.logs.name)
    start = time.perf_counter()
    bench.stack = LocalStack(config)
    try:
        bench.stack.start()
    except Exception:
        print(bench.log_tails(12), flush=True)
        bench.stop()
        raise
    out = {"start_s": round(time.perf_counter() - start, 1)}
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1000) for _ in range(w.prompt_tokens)] for _ in range(w.concurrency)]
    try:
        for run in ("first", "second"):
            traces, _, _ = send_streams(bench.stack.address, w, prompts, guard_s=300)
            s = summarize(traces)
            gaps = [b - a for t in traces for a, b in zip(t.times, t.times[1:])]
            out[run] = {k: s[k] for k in ("output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99")}
            out[run]["itl_ms_max"] = round(max(gaps) * 1e3, 1) if gaps else None
    finally:
        out["verifier_log_tail"] = bench.log_tails(3)
        bench.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    for name, extra in VARIANTS.items():
        results[name] = run_variant(args, extra)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "verifier_log_tail"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "bench/cold_start.py", "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
