"""Per-step round trip verifier -> drafter (bidi stream message + hidden-state transport), at several batch sizes.

Starts `specdec drafter` as a separate process, connects a RemoteDrafter as the verifier does, and times
propose() for a batch of B decoding sequences (each sending k+1 hidden rows, asking for k drafts). The drafter
reports its own compute time, so overhead = round trip - drafter time. With --kind mtp the same batches then run
through an MTPDrafter in this process (inproc_propose_ms: what `specdec bench`'s in-process path pays), so
drafter time - inproc_propose_ms is what the separate process itself adds (its hidden-state read and event wait,
message handling, the GPU switching between the two processes). Also reports each process's GPU memory.

    python bench/drafter_roundtrip.py --model DIR --device cuda --transport cuda_ipc --batch 1 32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from specdec.drafting import DraftBatch, DraftInput
from specdec_tools.local_stack import free_port
from specdec.models.loader import load_model
from specdec.rpc.health_probe import is_serving
from verifier_service.drafter_client import RemoteDrafter
from verifier_service.drafter_link import DrafterLinkConfig


def gpu_memory_by_pid() -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {int(p): int(m) for p, m in (line.split(",") for line in out.strip().splitlines() if line)}


def run(args) -> dict:
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    cfg, model = loaded.config, loaded.model
    port = free_port()
    drafter = subprocess.Popen([sys.executable, "-m", "specdec", "drafter", "--kind", args.kind, "--model", args.model,
                                "--device", args.device, "--dtype", args.dtype, "--port", str(port), "-k", str(args.k)])
    try:
        while not is_serving(f"127.0.0.1:{port}"):
            assert drafter.poll() is None, "drafter exited"
            time.sleep(0.2)
        link = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{port}", args.k, args.transport, 30.0),
                             cfg.hidden_size, cfg.vocab_size, model.embed_tokens.weight.dtype, torch.device(args.device),
                             max(args.batch) * (args.k + 1) + 4096,
                             {"embed_tokens": model.embed_tokens.weight, "lm_head": model.lm_head.weight}, cfg.model_type)
        while not link.connected:
            time.sleep(0.1)
        results = {"transport": link.transport_name, "kind": link.kind, "k": args.k, "device": args.device,
                   "hidden_size": cfg.hidden_size, "vocab": cfg.vocab_size, "batches": {}}
        dtype = model.embed_tokens.weight.dtype
        for batch in args.batch:
            rt, dm = [], []
            for step, draft_batch in draft_batches(args, batch, 1000 * batch, cfg.hidden_size, dtype):
                out = link.propose(draft_batch)
                assert all(len(d) == args.k for d in out.drafts) or step < 0, "drafter failed"
                if step >= args.warmup:
                    rt.append(link.last_round_trip_ms)
                    dm.append(link.last_drafter_ms)
            link.release([1000 * batch + i for i in range(batch)])
            over = [a - b for a, b in zip(rt, dm)]
            results["batches"][batch] = {
                "round_trip_ms_median": statistics.median(rt), "round_trip_ms_p90": sorted(rt)[int(0.9 * len(rt))],
                "drafter_ms_median": statistics.median(dm), "overhead_ms_median": statistics.median(over),
                "overhead_ms_p90": sorted(over)[int(0.9 * len(over))], "steps": len(rt)}
        if args.device == "cuda":
            mem = gpu_memory_by_pid()
            results["gpu_memory_mib"] = {"verifier (this process)": mem.get(os.getpid()),
                                         "drafter process": mem.get(drafter.pid)}
        link.close()
        drafter.terminate()
        drafter.wait(30)
        if args.kind == "mtp":
            for batch in args.batch:
                results["batches"][batch]["inproc_propose_ms_median"] = inproc_propose_ms(args, loaded, batch)
        return results
    finally:
        drafter.terminate()
        drafter.wait(30)


def draft_batches(args, batch: int, first_id: int, width: int, dtype: torch.dtype):
    """(step, DraftBatch): a 64-token prefill of `batch` sequences (step -1), then args.steps decode steps that
    accepted everything (k + 1 new positions each), random hidden rows; the device is idle at each yield."""
    prompt, ids = 64, range(first_id, first_id + batch)
    seqs = [DraftInput(i, 0, list(range(1, prompt + 2)), args.k) for i in ids]
    yield -1, DraftBatch(0, seqs, torch.randn(batch * prompt, width, device=args.device, dtype=dtype))
    pos = prompt
    for step in range(args.steps):
        seqs = [DraftInput(i, pos, list(range(5, 5 + args.k + 2)), args.k) for i in ids]
        hidden = torch.randn(batch * (args.k + 1), width, device=args.device, dtype=dtype)
        if args.device == "cuda":
            torch.cuda.synchronize()
        yield step, DraftBatch(step + 1, seqs, hidden)
        pos += args.k + 1


def inproc_propose_ms(args, loaded, batch: int) -> float:
    """Median propose() time of an MTPDrafter in this process over the batches the remote run sent."""
    from drafter_service.mtp.mtp_drafter import MTPDrafter
    from drafter_service.factory import DrafterConfig
    from drafter_service.mtp.options import MTPOptions
    # the sizes `specdec drafter` runs with by default, as the remote one above
    drafter = MTPDrafter(loaded, args.k, num_blocks=DrafterConfig.num_blocks, block_size=16, device=args.device,
                         options=MTPOptions())
    times = []
    for step, draft_batch in draft_batches(args, batch, 0, loaded.config.hidden_size,
                                           loaded.model.embed_tokens.weight.dtype):
        start = time.perf_counter()
        drafter.propose(draft_batch)   # ends in its one read of the drafts
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--kind", default="mtp")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--transport", default="auto")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    print(json.dumps(run(p.parse_args()), indent=1))


if __name__ == "__main__":
    main()
