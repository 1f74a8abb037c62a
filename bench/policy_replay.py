"""Replays `specdec bench --preset adaptive`'s inproc workload on this CPU: the real engine and scheduler on the tiny
random model, the synthetic drafter at a per-token acceptance (forced, as the bench does), and the adaptive policy
priced with the step costs a GPU run measured (read from that run's JSON), so that the policy's choices can be
studied without the GPU. Prints, per policy, the engine steps the workload took and the k each step verified
('-': a step that did not ask the policy: prefill only, a step that only read the last one, or one with no sequence
in the drafter). Requests are seeded as the bench seeds them, so the forced acceptance draws the same schedule.

    PYTHONPATH=$PWD:$PWD/bench python3 -P bench/policy_replay.py \\
        --costs bench/results/h100/bench_adaptive_h100.json --concurrency 16 --rate 0.9

Only the steps' count and the k sequence carry over to the GPU: the CPU's own step times do not.
"""
from __future__ import annotations

import argparse
import json

import torch
from step_bench import random_model

import specdec_tools.bench.inprocess as inprocess
from specdec.sampling_params import SamplingParams
from specdec_tools.bench.presets import length_of_rate
from specdec_tools.bench.workloads import Workload
from verifier_service.draft_policy import StepCosts


def measured_costs(path: str, concurrency: int, rate: float) -> tuple[StepCosts, str]:
    """The step costs a bench JSON recorded for the synthetic drafter's adaptive workload at this concurrency and
    rate, else those of its synthetic workload with the most batch sizes; and which workload's they are."""
    with open(path) as f:
        results = [r for r in json.load(f)["results"] if r["metrics"].get("step_costs_ms")]
    synthetic = [r for r in results if r.get("workload", {}).get("drafter") == "synthetic"]
    same = [r for r in synthetic if (r["workload"]["concurrency"], r["workload"]["accept_rate"]) == (concurrency, rate)]
    if not (same or synthetic):
        raise SystemExit(f"{path}: no adaptive workload of the synthetic drafter with step costs")
    chosen = (same or sorted(synthetic, key=lambda r: -len(r["metrics"]["step_costs_ms"]["batch_sizes"])))[0]
    return inprocess.costs_of_record(chosen["metrics"]["step_costs_ms"]), chosen["name"]


def replay(bench: inprocess.InprocBench, w: Workload, prompt_tokens: int) -> str:
    """The k each engine step verified ('-': it did not ask the policy) for w's requests sent at once."""
    engine = bench.build_engine(w)
    for i in range(w.concurrency):
        engine.add_request(f"r{i}", [3 + (i * 7 + j) % 200 for j in range(prompt_tokens)],
                           SamplingParams(max_tokens=w.max_tokens, seed=i, ignore_eos=True))
    verified, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda k: (verified.append(k), schedule(k))[1]
    chosen = []
    while engine.has_work:
        before = sum(engine.policy.chosen)
        asked = len(verified)
        engine.step()
        chosen.append(str(verified[-1]) if len(verified) > asked and sum(engine.policy.chosen) > before else "-")
    return "".join(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", required=True, help="a `specdec bench --preset adaptive` JSON (its step costs)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0.9, help="the synthetic drafter's per-token acceptance")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    costs, source = measured_costs(args.costs, args.concurrency, args.rate)
    print(f"step costs of {source}", flush=True)
    inprocess.measure_step_costs = lambda engine: setattr(engine.policy, "costs", costs) or costs
    cuda_sized = inprocess.scheduler_for
    inprocess.scheduler_for = lambda w, device_type: cuda_sized(w, "cuda")   # the GPU's step budget and chunks
    torch.manual_seed(0)
    bench = inprocess.InprocBench(random_model(2, torch.device("cpu"), smoke=True), torch.device("cpu"))
    for policy in ("fixed", "adaptive"):
        w = Workload("inproc", "synthetic", args.concurrency, args.prompt_tokens, args.max_tokens,
                     forced_length=length_of_rate(args.rate), accept_rate=args.rate, draft_policy=policy)
        ks = replay(bench, w, args.prompt_tokens)
        print(f"{policy:8s} {len(ks)} steps; k per step: {ks}", flush=True)


if __name__ == "__main__":
    main()
