"""What handing GPU work between two processes costs: the verifier / drafter step pattern, bare.

Each iteration, a "verifier" replays V ms of memory-bound GEMMs (a CUDA graph) and records an event; a "drafter"
waits on that event on its own stream, replays D ms of GEMMs and records its event; the verifier's next
iteration waits on that one. The hosts run ahead of the GPU as the engine does: the verifier queues iteration
i + 1 once the drafter answered that it queued iteration i (a pipe message), and syncs on iteration i - 2 (its
one host wait). Modes:

    one        both sides in one process, two streams (the colocated drafter)
    one_ipc    the same with interprocess events (what the split uses), to tell the event from the process
    two        the drafter in its own process (its own CUDA context), queued early: its stream waits on the
               verifier's event on the GPU (the device-step protocol)
    two_late   the drafter's host waits for the verifier's event first and only then queues (nothing of its
               context is pending while the verifier runs)

Reported: ms per iteration, and what it adds to V + D run back to back in one stream. Run it with and without
an MPS daemon (bench/gpu_split_cost.sh) to see whether the contexts' time-slicing is the cost.

    python3 bench/context_handoff.py --v-ms 6 --d-ms 1 --iters 300 --out DIR
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

HIDDEN = 4096
WEIGHTS = 12   # 12 x 32 MiB: more than the 50 MB L2, so each GEMM reads its weight from HBM


def gemm_graph(ms: float, device: torch.device) -> torch.cuda.CUDAGraph:
    """A graph of [16, 4096] x [4096, 4096] bf16 GEMMs that takes about `ms` (timed, then sized)."""
    x = torch.randn(16, HIDDEN, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(WEIGHTS)]

    def build(n: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for w in weights[:2]:
                torch.mm(x, w)                  # (cuBLAS picks its kernel outside the capture)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                torch.mm(x, weights[i % WEIGHTS])
        graph._keep = (x, weights)              # the graph reads them by address
        return graph

    probe = build(64)
    per_gemm = time_replays(probe, device) / 64
    return build(max(1, round(ms / per_gemm)))


def time_replays(graph: torch.cuda.CUDAGraph, device: torch.device, reps: int = 20) -> float:
    graph.replay()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / reps


def drafter_process(conn, d_ms: float, late: bool) -> None:
    """The drafter's side in its own process: events come as IPC handles, steps as pipe messages."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    graph = gemm_graph(d_ms, device)
    stream = torch.cuda.Stream(device)
    done = torch.cuda.Event(interprocess=True)
    conn.send(done.ipc_handle())
    verified = torch.cuda.Event.from_ipc_handle(device, conn.recv())
    conn.send("ready")
    while True:
        step = conn.recv()
        if step is None:
            break
        if late:
            verified.synchronize()
        with torch.cuda.stream(stream):
            stream.wait_event(verified)
            graph.replay()
            done.record(stream)
        conn.send(step)
    torch.cuda.synchronize(device)
    conn.close()


class LocalDrafter:
    """The drafter's side in the verifier's process (modes one and one_ipc)."""

    def __init__(self, d_ms: float, device: torch.device, interprocess: bool):
        self.graph, self.stream = gemm_graph(d_ms, device), torch.cuda.Stream(device)
        self.done = torch.cuda.Event(interprocess=interprocess)
        self.verified: torch.cuda.Event | None = None

    def step(self) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.verified)
            self.graph.replay()
            self.done.record(self.stream)


def run_mode(mode: str, v_ms: float, d_ms: float, d_alone: float, iters: int) -> dict:
    """One mode: ms per iteration and what it adds to V (timed here) + D (`d_alone`, timed by the caller)."""
    device = torch.device("cuda", 0)
    verify = gemm_graph(v_ms, device)
    v_alone = time_replays(verify, device)
    stream = torch.cuda.Stream(device)
    verified = torch.cuda.Event(interprocess=mode != "one")
    child = conn = local = None
    if mode.startswith("two"):
        conn, child_conn = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=drafter_process, args=(child_conn, d_ms, mode == "two_late"))
        child.start()
        drafted = torch.cuda.Event.from_ipc_handle(device, conn.recv())
        conn.send(verified.ipc_handle())
        assert conn.recv() == "ready"
    else:
        local = LocalDrafter(d_ms, device, interprocess=mode == "one_ipc")
        local.verified, drafted = verified, local.done
    marks: list[torch.cuda.Event] = []
    for i in range(iters):
        if i == 10:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
        with torch.cuda.stream(stream):
            if i > 0:
                stream.wait_event(drafted)
            verify.replay()
            verified.record(stream)
            mark = torch.cuda.Event()
            mark.record(stream)
        marks.append(mark)
        if local is not None:
            local.step()
        else:
            conn.send(i)
            assert conn.recv() == i
        if len(marks) > 2:
            marks.pop(0).synchronize()    # the verifier's one host wait: two steps back
    torch.cuda.synchronize(device)
    per_iter = (time.perf_counter() - start) * 1e3 / (iters - 10)
    if child is not None:
        conn.send(None)
        child.join(timeout=30)
    return {"mode": mode, "v_ms": round(v_alone, 4), "d_ms": round(d_alone, 4), "ms_per_iter": round(per_iter, 4),
            "added_ms": round(per_iter - v_alone - d_alone, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--v-ms", type=float, nargs="+", default=[4.0, 6.0])
    p.add_argument("--d-ms", type=float, nargs="+", default=[0.7, 1.0])
    p.add_argument("--modes", nargs="+", default=["one", "one_ipc", "two", "two_late"])
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for v in args.v_ms:
        for d in args.d_ms:
            device = torch.device("cuda", 0)
            d_alone = time_replays(gemm_graph(d, device), device)
            for mode in args.modes:
                row = run_mode(mode, v, d, d_alone, args.iters)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "context_handoff.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
