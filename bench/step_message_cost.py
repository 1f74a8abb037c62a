"""What a device step's message costs the two hosts, sent whole and as changes (drafter.proto, DeviceStep):
bytes on the wire, and host µs to build and serialize it (verifier) and to parse and decode it (drafter), for a
steady decoding batch at k = 3 whose drafts are accepted 2.2 of 3 on average. CPU only, no model:

    python3 bench/step_message_cost.py [--steps 2000] [--batches 1 16 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from drafter_service.device_step import read_schedule
from specdec.drafting import DeviceSchedule, changes_between
from specdec.rpc.v1 import drafter_pb2 as pb
from verifier_service.device_step_link import device_message

K = 3
HIDDEN = pb.TensorRef(transport=pb.CUDA_IPC, dtype="bfloat16", buffer="hidden")


def steady_schedules(batch: int, steps: int, seed: int = 0) -> list[DeviceSchedule]:
    """Each step's schedule as the overlapped verifier sends it: starts move by the committed rows it has read
    (one step late), max_shift is the last step's drafts."""
    rng = np.random.default_rng(seed)
    start, unread = np.arange(batch, dtype=np.int64) * 7 + 100, np.zeros(batch, np.int64)
    out = []
    for _ in range(steps):
        out.append(DeviceSchedule.of(np.arange(batch), start, np.full(batch, K), np.full(batch, K + 1),
                                     np.full(batch, K)))
        start = start + 1 + unread
        unread = rng.choice(4, size=batch, p=[0.1, 0.15, 0.2, 0.55])
    return out


def message(step: int, schedule, changes) -> bytes:
    m = pb.StepInput(step=step, device=device_message(schedule if changes is None else changes))
    if changes is None:
        m.hidden.CopyFrom(HIDDEN)
        m.hidden.shape[:] = [int(schedule.chunk_lens.sum()), 2560]
    return pb.DraftStepRequest(step=m).SerializeToString()


def measure(schedules: list[DeviceSchedule], as_changes: bool) -> dict:
    held_v = held_d = None
    build, parse, sizes = [], [], []
    for n, schedule in enumerate(schedules, 1):
        t0 = time.perf_counter()
        changes, holds = changes_between(held_v, schedule) if as_changes else (None, schedule)
        wire = message(n, schedule, changes)
        t1 = time.perf_counter()
        step = pb.DraftStepRequest.FromString(wire).step
        decoded = read_schedule(step.device, held_d)
        t2 = time.perf_counter()
        held_v, held_d = holds, decoded
        build.append(t1 - t0)
        parse.append(t2 - t1)
        sizes.append(len(wire))
    return {"bytes": statistics.mean(sizes[1:]), "build_us": statistics.median(build[1:]) * 1e6,
            "parse_us": statistics.median(parse[1:]) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    print("batch  form     bytes  build+serialize µs  parse+decode µs")
    for b in args.batches:
        schedules = steady_schedules(b, args.steps)
        for as_changes in (False, True):
            r = measure(schedules, as_changes)
            print(f"{b:5d}  {'changes' if as_changes else 'whole':7s} {r['bytes']:6.1f}  {r['build_us']:18.1f}  "
                  f"{r['parse_us']:15.1f}")


if __name__ == "__main__":
    main()
