"""The all-reduce of a decode step, alone: a CUDA graph of REPS back-to-back in-place sums of [rows, hidden] bf16
over N GPUs, by NCCL (dist.all_reduce) and by the one-shot kernel the verifier uses (`--all-reduce one-shot`:
specdec.models.tensor_parallel.OneShotAllReduce). Each graph is checked first (every rank fills its messages with
rank-dependent values; after a replay each must hold the sum), then timed: µs per all-reduce = a replay's wall time
/ REPS. A chain of dependent launches, so each all-reduce's wait for the slowest rank is in it, as in a step.

    torchrun --nproc-per-node 2 bench/allreduce_chain.py --rows 1 4 16 64 256 --out $OUT/allreduce.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from specdec.models.tensor_parallel import OneShotAllReduce


def chain_us(fn, rows: int, hidden: int, reps: int, replays: int, rank: int, size: int,
             offset: int = 0) -> tuple[float, bool]:
    """(µs per all-reduce in a graph of `reps`, whether every sum was right); each message starts `offset`
    elements into its allocation."""
    xs = [torch.empty(rows * hidden + offset, dtype=torch.bfloat16, device="cuda")[offset:].view(rows, hidden)
          for _ in range(reps)]                                                                  # [rows, hidden]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up outside the graph (NCCL's first call sets up its channels)
        for x in xs[:3]:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in xs:
            fn(x)
    for i, x in enumerate(xs):   # small integers: exact in bf16
        x.fill_(float(i % 7 + rank + 1))
    graph.replay()
    torch.cuda.synchronize()
    right = all(bool((x == float(size * (i % 7 + 1) + size * (size - 1) // 2)).all()) for i, x in enumerate(xs))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays / reps * 1e6, right


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--hidden", type=int, default=2048, help="the model's hidden size (default: the 80B-A3B's)")
    p.add_argument("--reps", type=int, default=100, help="all-reduces in one graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--offset", type=int, default=0, metavar="ELEMENTS",
                   help="each message starts this many elements into its allocation (1: not 16-byte aligned, "
                        "which the one-shot kernel takes through an aligned copy)")
    p.add_argument("--out", default=None, help="JSON file (rank 0 writes it)")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dist.all_reduce(torch.zeros(1, device="cuda"))
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"   # as the verifier's ranks: no NVLink multicast object
    one_shot = OneShotAllReduce(max(args.rows) * args.hidden * 2, torch.bfloat16, torch.device("cuda", rank))
    one_shot.join()
    rows = []
    for n in args.rows:
        row = {"rows": n, "bytes": n * args.hidden * 2}
        for name, fn in (("nccl", dist.all_reduce), ("one_shot", one_shot)):
            us, right = chain_us(fn, n, args.hidden, args.reps, args.replays, rank, size, args.offset)
            row[f"{name}_us"], row[f"{name}_right"] = round(us, 2), right
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0 and args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "ranks": size,
                                              "hidden": args.hidden, "reps": args.reps, "offset": args.offset,
                                              "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
