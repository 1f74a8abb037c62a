"""Where the time of issue 11's missed targets goes, on a random 4B-shaped model (32 layers, bf16, graphs on):

`--preset` / `--layers` take another make-tiny shape (random weights made on the device), e.g. the 80B's layers.

1. prefill steps (eager): N prompts x L tokens in one step, wall ms and prompt tokens/s, then a profile of one
2. engine steps at batch 1 and 16 (`--concurrency`), plain and MTP k = 3 at forced acceptance 3.39: wall per
   step, the engine's phases, and the profiler's top host (self CPU) and GPU entries (engine_step_profile.py).
3. `--chunked-prompt L:N[:D] ...` (instead of 1 and 2): one L-token prompt in N-token steps, as a server prefills
   it (issue 38's TTFT), with D decoding sequences in each step (its interference): wall ms of each step in graphs
   and eagerly, and the profiler's top GPU kernels of the eager run (the same kernels the graphs replay).
4. `--tensor-parallel-size N`: only 2's engine steps, of the preset's shape split over N ranks (rank r on cuda:r,
   each making its own random shard), the synthetic drafter's k = 3 random drafts in place of MTP's (no rank holds
   the whole embedding and LM head the MTP drafter reads), their acceptance forced the same. The profiler sees rank
   0: its NCCL kernels' time is where its GPU waits for the others. Every rank r > 0 logs its host's wait for rank
   0's message and its launch of a step (rank_step_stats.py) every RANK_STATS_EVERY_S seconds and when its engine
   closes; a window also holds the engine's warm-up and profiled steps, few beside the others: read its medians.
Run on the GPU machine: PYTHONPATH=$PWD:$PWD/bench python3 -P bench/profile_steps.py [--out DIR] (-P: bench/kernels.py
would shadow the kernels package)
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from draft_loop_bench import random_mtp_weights
from engine_step_profile import ACTIVITIES, DRAFTERS, SORT, engine_steps, parallel_engine_steps, sync, workloads
from step_bench import random_model
from torch.profiler import profile

from specdec_tools.bench.inprocess import InprocBench
from specdec.models import gated_deltanet
from specdec.models.loader import load_model
from specdec_tools.tiny import make_tiny
from verifier_service.builder import DEVICE_LIMITS
from verifier_service.executor import Executor
from verifier_service.sequence import Sequence

PREFILL_CASES = ((1, 128), (4, 128), (16, 128), (1, 512), (4, 512), (1, 2048), (2, 2048), (1, 4096))
GPU_TOKENS = DEVICE_LIMITS["cuda"]["max_batched_tokens"]   # the verifier's default token budget on a GPU


def dummy_model(preset: str, layers: int, device: torch.device):
    """A random model of a make-tiny preset's config (its own family: qwen3_next for the 80B), in bf16, made on the
    device (`--load-format dummy`: no weights written)."""
    with tempfile.TemporaryDirectory(prefix=f"specdec-{preset}-") as folder:
        make_tiny(folder, preset=preset, overrides={"num_hidden_layers": layers}, weights=False, dtype="bfloat16")
        return load_model(folder, dtype="bfloat16", device=device, load_format="dummy")


def prefill_once(executor: Executor, prompts: int, length: int) -> float:
    seqs = [Sequence(i, list(range(7, 7 + length)), length) for i in range(prompts)]
    sync()
    start = time.perf_counter()
    executor.forward(seqs, [s.token_ids for s in seqs])
    sync()
    wall = time.perf_counter() - start
    for s in seqs:
        executor.blocks.release(s)
    return wall


def prefill_table(loaded, device, cases=PREFILL_CASES) -> list[dict]:
    """Each case with the GDN prefill always chunked (fla-core when installed) and always our fused recurrent
    kernel: where the two cross is what gated_deltanet.CHUNKED_PREFILL_MIN_TOKENS is set from."""
    executor = Executor.build(loaded, 64 * 140, 16, 64, 0, device, max_batched_tokens=4096,
                              enforce_eager=True)   # graphs captured on one GDN path would hide the other
    rows, chunked_from = [], gated_deltanet.CHUNKED_PREFILL_MIN_TOKENS
    for gdn, threshold in (("chunk", 1), ("recurrent", 1 << 30)):
        gated_deltanet.CHUNKED_PREFILL_MIN_TOKENS = threshold
        for prompts, length in cases:
            prefill_once(executor, prompts, length)   # compile / autotune this shape class
            ms = statistics.median(prefill_once(executor, prompts, length) for _ in range(5)) * 1e3
            rows.append({"gdn": gdn, "prompts": prompts, "length": length, "ms": round(ms, 2),
                         "tokens_per_s": round(prompts * length / ms * 1e3)})
            print(f"prefill {gdn:9s} {prompts:3d} x {length:5d}: {ms:8.2f} ms  {rows[-1]['tokens_per_s']:8d} tok/s",
                  flush=True)
    gated_deltanet.CHUNKED_PREFILL_MIN_TOKENS = chunked_from
    with profile(activities=ACTIVITIES, with_stack=True) as prof:
        prefill_once(executor, 4, 128)
    print(prof.key_averages().table(sort_by=SORT, row_limit=25, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    by_stack = prof.key_averages(group_by_stack_n=4)
    print(by_stack.table(sort_by="count", row_limit=25, max_name_column_width=40))
    return rows


def chunked_prompt(loaded, device, length: int, chunk: int, beside: int = 0) -> dict:
    """One prompt of `length` tokens prefilled in steps of `chunk` tokens, in CUDA graphs and eagerly; with `beside`
    decoding sequences (128-token prompts, prefilled first and untimed) each running one token in every step, as
    when a long prompt arrives among decoders (issue 38's interference). Token budget: the GPU default or the
    step's tokens if more."""
    record, runs = {"length": length, "chunk": chunk, "beside": beside}, {}
    vocab = loaded.config.vocab_size
    for mode, eager in (("graphs", False), ("eager", True)):
        decoder_blocks = -(-(128 + -(-length // chunk) + 1) // 16)     # its prompt and a token per step
        executor = Executor.build(loaded, length // 16 + 8 + beside * decoder_blocks, 16, 1 + beside, 0, device,
                                  max_batched_tokens=max(GPU_TOKENS, chunk + beside), enforce_eager=eager)

        def run() -> list[float]:
            seq, walls = Sequence(0, [7 + i % (vocab - 8) for i in range(length)], length), []
            decoders = [Sequence(1 + i, [7 + (i * 131 + j) % (vocab - 8) for j in range(128)], 128)
                        for i in range(beside)]
            if decoders:
                executor.forward(decoders, [d.token_ids[:] for d in decoders])
                for d in decoders:
                    d.num_cached = len(d.token_ids)
            for start in range(0, length, chunk):
                piece = seq.token_ids[start: start + chunk]
                for d in decoders:
                    d.token_ids.append(7)
                sync()
                t0 = time.perf_counter()
                executor.forward([*decoders, seq], [*([7] for _ in decoders), piece])
                sync()
                walls.append(round((time.perf_counter() - t0) * 1e3, 2))
                seq.launched(len(piece), 0, samples=False, decoding=False)
                for d in decoders:
                    d.num_cached += 1
            for s in (seq, *decoders):
                executor.blocks.release(s)
            return walls
        run()                                                   # compile / autotune
        walls, runs[mode] = run(), run
        record[mode] = {"total_ms": round(sum(walls), 1), "step_ms": walls}
        print(f"prompt {length} in chunks of {chunk} beside {beside} decoders, {mode}: {sum(walls):.1f} ms; "
              f"steps {walls}", flush=True)
    with profile(activities=ACTIVITIES) as prof:
        runs["eager"]()
        sync()
    print(prof.key_averages().table(sort_by=SORT, row_limit=40, max_name_column_width=100))
    return record


def write(record: dict, out: str | None) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "profile_steps.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-engine", action="store_true", help="the prefill table only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    parser.add_argument("--preset", default="qwen3.5-4b",
                        help="a make-tiny preset (its family's config, random weights made on the device: "
                             "qwen3-next-80b-a3b with --layers 8 fits one H100); default the 4B shape")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="engine steps' batch sizes")
    parser.add_argument("--chunked-prompt", metavar="L:N[:D]", nargs="+", default=None,
                        help="only profile one L-token prompt prefilled in N-token steps (e.g. 8192:1024), with D "
                             "decoding sequences in each step (default 0); several cases one after the other")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="N > 1: only the engine steps, of --preset's shape (with --layers) over N ranks "
                             "(GPUs 0..N-1), the synthetic drafter in place of MTP")
    parser.add_argument("--all-reduce", default="one-shot", choices=["one-shot", "nccl"],
                        help="with --tensor-parallel-size: the verifier's --all-reduce")
    args = parser.parse_args()
    parallel = args.tensor_parallel_size > 1
    cases = [case.split(":") for case in args.chunked_prompt or []]
    if not all(len(c) in (2, 3) and all(x.isdigit() and int(x) > 0 for x in c[:2]) and all(x.isdigit() for x in c)
               for c in cases):
        parser.error(f"--chunked-prompt takes L:N or L:N:D (positive L and N, D >= 0), got {args.chunked_prompt}")
    if parallel and (args.chunked_prompt or args.skip_engine):
        parser.error("--tensor-parallel-size profiles engine steps only: not with --chunked-prompt or --skip-engine")
    device = torch.device("cpu" if args.smoke else "cuda")
    device_name = str(device) if args.smoke else torch.cuda.get_device_name()
    if parallel:
        write({"device": device_name, "tensor_parallel_size": args.tensor_parallel_size,
               "all_reduce": args.all_reduce, "prefill": [],
               "engine": parallel_engine_steps(args.preset, args.layers, args.tensor_parallel_size, args.concurrency,
                                               device, args.smoke, args.all_reduce)}, args.out)
        return
    loaded = (random_model(2 if args.smoke else args.layers, device, smoke=args.smoke)
              if args.smoke or args.preset == "qwen3.5-4b" else dummy_model(args.preset, args.layers, device))
    if args.chunked_prompt:
        write({"device": device_name, "chunked_prompt": [chunked_prompt(loaded, device, *map(int, case))
                                                         for case in cases]}, args.out)
        return
    record = {"device": device_name, "tensor_parallel_size": 1, "prefill": [] if args.skip_prefill else
              prefill_table(loaded, device, PREFILL_CASES[:2] if args.smoke else PREFILL_CASES)}
    loaded.mtp_weights = random_mtp_weights(loaded, device)
    bench = InprocBench(loaded, device)
    record["engine"] = [] if args.skip_engine else [engine_steps(bench, w)
                                                    for w in workloads(args.concurrency, DRAFTERS, args.smoke)]
    write(record, args.out)


if __name__ == "__main__":
    main()
