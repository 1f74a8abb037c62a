"""The inproc path of `specdec bench` (specdec_tools/bench/inprocess.py): steps sized as the verifier sizes them
on the device, and the fixed and the adaptive draft policy of one drafter measured on one engine, their passes
paired, and with plain decoding's passes on the plain engine kept beside it; the bench scripts that drive it
(bench/policy_replay.py, bench/profile_steps.py over tensor-parallel ranks)."""
import json
import os
import re
import subprocess
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from specdec_tools.bench import workloads as wl


def test_fixed_and_adaptive_policies_are_measured_on_one_engine(tiny_model):
    """A workload that differs from the last only in its draft policy runs on the last one's engine (its step
    costs measured then, its timing wrappers gone after each run); any other difference builds a new engine, and
    the old one is freed."""
    from specdec_tools.bench.inprocess import InprocBench
    bench = InprocBench(tiny_model, torch.device("cpu"))
    fixed = wl.Workload("inproc", "mtp", concurrency=2, prompt_tokens=9, max_tokens=80, forced_length=2.5)
    adaptive = replace(fixed, draft_policy="adaptive")     # (long enough for the step costs' measurement)
    prompts = wl.prompts_for(fixed, 257)
    first = bench.run(fixed, prompts, guard_s=120)
    engine = bench._engine
    assert first["step_costs_ms"] is None and not engine.policy.adaptive
    second = bench.run(adaptive, prompts, guard_s=120)
    assert bench._engine is engine and engine.policy.adaptive and second["step_costs_ms"] is not None
    # each adaptive pass was followed by a fixed one on the same engine (one pass each here)
    assert len(second["paired_fixed_passes_tokens_per_s"]) == len(second["passes_tokens_per_s"]) == 1
    assert second["paired_fixed_tokens_per_s"] > 0 and "paired_fixed_tokens_per_s" not in first
    assert next(bench._salts) == 5      # warm-up and pass of each, the paired pass: every one rotated its own way
    assert "forward" not in vars(engine.executor) or vars(engine.executor)["forward"].__name__ != "timed"
    assert first["completion_tokens"] == second["completion_tokens"] == 160
    gone = weakref.ref(engine)
    del engine
    bench.run(replace(fixed, concurrency=1), prompts[:1], guard_s=120)
    assert bench._engine is not None and not bench._engine.policy.adaptive
    assert gone() is None          # freed: the bench keeps no reference to it
    bench.release()
    assert bench._engine is None


def test_adaptive_passes_alternate_with_the_kept_plain_engines(tiny_model):
    """The plain workload's engine is kept beside the drafter's (one engine each, the weights shared): each adaptive
    pass comes with a fixed pass and a plain pass on it (`paired_plain_*`); a workload of another shape frees
    it."""
    from specdec_tools.bench.inprocess import InprocBench
    bench = InprocBench(tiny_model, torch.device("cpu"), repeats=2)
    plain_w = wl.Workload("inproc", "none", concurrency=2, prompt_tokens=9, max_tokens=80)
    fixed = replace(plain_w, drafter="mtp", forced_length=2.5)
    prompts = wl.prompts_for(plain_w, 257)
    plain = bench.run(plain_w, prompts, guard_s=120)
    plain_engine = bench._plain
    assert plain_engine is not None and "paired_plain_tokens_per_s" not in plain
    bench.run(fixed, prompts, guard_s=120)
    assert bench._plain is plain_engine and bench._engine is not plain_engine
    steps = plain_engine.step_count
    adaptive = bench.run(replace(fixed, draft_policy="adaptive"), prompts, guard_s=120)
    assert len(adaptive["paired_plain_passes_tokens_per_s"]) == len(adaptive["passes_tokens_per_s"]) == 2
    assert adaptive["paired_plain_tokens_per_s"] > 0 and plain_engine.step_count >= steps + 2 * 80
    assert next(bench._plain_salts) == 5    # its own warm-up and 2 passes, then 2 paired: each rotated its own way
    gone = weakref.ref(plain_engine)
    del plain_engine
    bench.run(replace(fixed, concurrency=1), prompts[:1], guard_s=120)
    assert bench._plain is None and gone() is None


def test_each_round_of_paired_passes_starts_with_another_one(tiny_model):
    """Round r of the adaptive, fixed and plain passes runs kind r first, the others in their order: each runs first
    once in three rounds, and the adaptive and the fixed pass each follow the plain engine's pass once; the fixed
    pass runs with the policy's adaptive flag off, the adaptive one with it on."""
    from specdec_tools.bench.inprocess import InprocBench
    bench = InprocBench(tiny_model, torch.device("cpu"), repeats=3)
    plain_w = wl.Workload("inproc", "none", concurrency=1, prompt_tokens=9, max_tokens=12)
    fixed = replace(plain_w, drafter="mtp", forced_length=2.5)
    prompts = wl.prompts_for(plain_w, 257)
    bench.run(plain_w, prompts, guard_s=120)
    bench.run(fixed, prompts, guard_s=120)
    order, timed = [], bench._timed_pass

    def spy(engine, w, *args):
        kind = "plain" if engine is bench._plain else ("adaptive" if engine.policy.adaptive else "fixed")
        assert (w.draft_policy == "adaptive") == (kind == "adaptive") and (w.drafter == "none") == (kind == "plain")
        order.append(kind[0])
        return timed(engine, w, *args)
    bench._timed_pass = spy
    bench.run(replace(fixed, draft_policy="adaptive"), prompts, guard_s=120)
    assert "".join(order) == "afp" + "fap" + "paf"


def test_inproc_steps_are_sized_as_the_verifier_sizes_them_on_the_device():
    """The verifier's default token budget and prefill chunk for the device (builder.DEVICE_LIMITS), widened so
    that every running sequence verifies in one step."""
    from specdec_tools.bench.inprocess import scheduler_for
    from verifier_service.builder import DEVICE_LIMITS
    w = wl.Workload("inproc", "mtp", concurrency=64, prompt_tokens=128, max_tokens=8)
    for device in ("cuda", "cpu"):
        s = scheduler_for(w, device)
        assert (s.max_batched_tokens, s.prefill_chunk, s.max_running) == (
            max(DEVICE_LIMITS[device]["max_batched_tokens"], 64 * 4), DEVICE_LIMITS[device]["prefill_chunk"], 64)
    assert scheduler_for(wl.Workload("inproc", "mtp", concurrency=512, prompt_tokens=8, max_tokens=8),
                         "cuda").max_batched_tokens == 512 * 4


def test_the_policy_replay_runs_both_policies_priced_with_a_runs_step_costs(tmp_path):
    """bench/policy_replay.py (the adaptive workload replayed on the CPU with a GPU run's step costs) reads the
    costs of the synthetic drafter's workload from a bench JSON and prints, per policy, its engine steps and the k
    of each; a JSON without such costs is refused."""
    repo = Path(__file__).resolve().parents[1]
    costs = {"results": [{"name": "inproc/syn@0.9+adaptive/c2", "metrics": {"step_costs_ms": {
        "batch_sizes": [1, 2], "ms": [[4.1, 5.1, 5.2, 5.3], [4.2, 5.2, 5.3, 5.4]],
        "drafts": [[0, 1, 2, 3], [0, 1, 2, 3]], "plain_ms": [4.1, 4.2]}},
        "workload": {"drafter": "synthetic", "concurrency": 2, "accept_rate": 0.9}}]}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{repo / 'bench'}")

    def replay(costs_file):
        return subprocess.run([sys.executable, "-P", "bench/policy_replay.py", "--costs", str(costs_file),
                               "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "16"], cwd=repo,
                              env=env, capture_output=True, text=True, timeout=240)
    done = replay(path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step costs of inproc/syn@0.9+adaptive/c2" in done.stdout
    lines = re.findall(r"^(fixed|adaptive) +(\d+) steps; k per step: ([-0-3]+)$", done.stdout, re.M)
    assert [policy for policy, _, _ in lines] == ["fixed", "adaptive"], done.stdout
    for _, steps, ks in lines:
        assert int(steps) == len(ks) and "3" in ks           # a step count, and drafts verified at the good rate
    path.write_text(json.dumps({"results": [{"metrics": {}}]}))
    refused = replay(path)
    assert refused.returncode != 0 and "no adaptive workload of the synthetic drafter" in refused.stderr


def test_profile_steps_profiles_a_tensor_parallel_engines_steps(tmp_path):
    """bench/profile_steps.py --tensor-parallel-size 2 (CPU, gloo): the engine steps of a make-tiny preset over two
    ranks, plain and the synthetic drafter's at forced acceptance, each engine's ranks stopped (rank 1's line of
    host time per step at its stop); --chunked-prompt runs no ranks and is refused."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{repo / 'bench'}")

    def profile(*args):
        return subprocess.run([sys.executable, "-P", "bench/profile_steps.py", "--smoke", "--tensor-parallel-size",
                               "2", "--preset", "tiny", "--layers", "2", *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=240)
    done = profile("--concurrency", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "profile_steps.json").read_text())
    assert record["tensor_parallel_size"] == 2 and record["prefill"] == []
    assert [(e["workload"].split("/")[1], e["forced_acceptance_length"]) for e in record["engine"]] == [
        ("none", None), ("syn@0.89", 3.39)]
    assert all(e["median_step_ms"] > 0 and e["launch_parts_ms"]["LAUNCH (all)"] > 0 for e in record["engine"])
    assert len(re.findall(r"rank 1: \d+ steps in .* launching the step [\d.]+ ms a step", done.stderr)) >= 2
    refused = profile("--chunked-prompt", "64:32")
    assert refused.returncode == 2 and "not with --chunked-prompt" in refused.stderr


def test_profile_steps_times_a_chunked_prompt_alone_and_beside_decoders(tmp_path):
    """bench/profile_steps.py --chunked-prompt L:N[:D] (CPU smoke): each case's steps, one per chunk, with the D
    decoding sequences in every one of them (their cache stays valid: a step of 3 decoders and a 32-token chunk
    runs), in graph mode and eagerly."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{repo / 'bench'}")
    done = subprocess.run([sys.executable, "-P", "bench/profile_steps.py", "--smoke", "--chunked-prompt", "64:32",
                           "96:32:3", "--out", str(tmp_path)], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads((tmp_path / "profile_steps.json").read_text())["chunked_prompt"]
    assert [(c["length"], c["chunk"], c["beside"]) for c in cases] == [(64, 32, 0), (96, 32, 3)]
    assert [len(c[mode]["step_ms"]) for c in cases for mode in ("graphs", "eager")] == [2, 2, 3, 3]
    assert "beside 3 decoders, eager" in done.stdout
