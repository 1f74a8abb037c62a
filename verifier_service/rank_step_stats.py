"""A tensor-parallel rank r > 0's host time per step, logged once a window of `every_s` seconds and at stop: its wait
for rank 0's message (which includes rank 0's own host work between two steps and the wait of rank 0 for the step
it reads first) and its launch of the step (the cache ops and its shard's kernels queued: on a GPU the kernels run
after). A wait of IDLE_S or more is idle time (start-up, no requests), counted apart: it says nothing of a step.
"""
from __future__ import annotations

import statistics

IDLE_S = 1.0


class RankStepStats:
    NUM_KEPT = 4096   # the steps of a window whose times make its medians (the first ones)

    def __init__(self, rank: int, every_s: float):
        self.rank, self.every_s = rank, every_s
        self._new_window()

    def _new_window(self) -> None:
        self.started: float | None = None      # the window's first step began (its wait, unless idle)
        self.ended = 0.0                       # the last step's launch returned
        self.num_steps, self.num_waits, self.idle_s = 0, 0, 0.0
        self.waiting_s, self.launching_s, self.max_launching_s = 0.0, 0.0, 0.0
        self.waits: list[float] = []
        self.launches: list[float] = []

    def add(self, waiting_from: float, launching_from: float, done: float) -> str | None:
        """One step: its wait for rank 0's message began at `waiting_from`, its launch at `launching_from`, and
        the launch returned at `done`. The window's line when it ends here (the next window begins with the next
        step), else None."""
        waiting_s, launching_s = launching_from - waiting_from, done - launching_from
        idle = waiting_s >= IDLE_S
        if self.started is None:
            self.started = launching_from if idle else waiting_from
        elif idle:
            self.idle_s += waiting_s
        if not idle:
            self.num_waits += 1
            self.waiting_s += waiting_s
            if len(self.waits) < self.NUM_KEPT:
                self.waits.append(waiting_s)
        self.ended = done
        self.num_steps += 1
        self.launching_s += launching_s
        self.max_launching_s = max(self.max_launching_s, launching_s)
        if len(self.launches) < self.NUM_KEPT:
            self.launches.append(launching_s)
        if self.every_s <= 0 or done - self.started < self.every_s:
            return None
        return self.close()

    def close(self) -> str | None:
        """The line of the steps since the last one (None if none, or with every_s 0); a new window begins."""
        line = self.line() if self.num_steps and self.every_s > 0 else None
        self._new_window()
        return line

    def line(self) -> str:
        n, ms = self.num_steps, 1e3
        idle = f", {self.idle_s:.1f} s of it idle" if self.idle_s else ""
        waits = (f"{self.waiting_s / self.num_waits * ms:.2f} ms a step (p50 {statistics.median(self.waits) * ms:.2f})"
                 if self.num_waits else "-")
        return (f"rank {self.rank}: {n} step{'s' if n != 1 else ''} in {self.ended - self.started:.1f} s{idle}: "
                f"waiting for rank 0's message {waits}, launching the step {self.launching_s / n * ms:.2f} ms a step "
                f"(p50 {statistics.median(self.launches) * ms:.2f}, max {self.max_launching_s * ms:.1f})")
