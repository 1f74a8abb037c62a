"""Timestamps of the step's phases, per process (`--trace-steps FILE` on the verifier and the drafter), for
finding where a step's wall time goes between the two processes (`specdec trace-report` lines them up).

`time.perf_counter` is CLOCK_MONOTONIC on Linux: one clock for every process of a host, so the verifier's and
the drafter's marks compare directly. Any thread may mark; the marks go to the file as JSON lines every
`flush_every` marks and at close. Off (no path): mark does nothing. On, the process's garbage collections are
marked too ("gc.start" / "gc.stop", batch = the generation collected): a collection stops every thread of the
process, so a long one shows as a long step.

PhaseClock: the host seconds of one step's phases, for the engine's per-step split (metrics, benchmarks).
"""
from __future__ import annotations

import gc
import gzip
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


class StepTrace:
    def __init__(self, path: str | os.PathLike | None = None, process: str = "", flush_every: int = 4096):
        self.path = Path(path) if path else None
        self.process, self.flush_every = process, flush_every
        self._marks: list[tuple[float, str, int, int]] = []   # (perf_counter seconds, event, step or -1, batch)
        self._lock = threading.Lock()                     # guards _marks
        self._write_lock = threading.Lock()               # one writer of the file at a time
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            gc.callbacks.append(self._collection)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def mark(self, event: str, step: int = -1, batch: int = 0) -> None:
        """`step`: the drafter link's step counter where the event has one; `batch`: sequences in the step."""
        if self.path is None:
            return
        with self._lock:
            self._marks.append((time.perf_counter(), event, step, batch))
            full = len(self._marks) >= self.flush_every
        if full:
            self.flush()

    def _collection(self, phase: str, info: dict) -> None:
        # (no lock: a collection may start inside mark() while this thread holds it; one append is atomic)
        self._marks.append((time.perf_counter(), f"gc.{phase}", -1, info["generation"]))

    def flush(self) -> None:
        if self.path is None:
            return
        with self._write_lock:
            with self._lock:
                marks, self._marks = self._marks, []
            with self.path.open("a") as f:
                for t, event, step, batch in marks:
                    f.write(json.dumps({"t": t, "process": self.process, "event": event, "step": step,
                                        "batch": batch}) + "\n")

    def close(self) -> None:
        if self._collection in gc.callbacks:
            gc.callbacks.remove(self._collection)
        self.flush()


OFF = StepTrace()   # the default of every component that takes a trace


def read_marks(paths: list[str | os.PathLike]) -> list[dict]:
    """Every mark of these trace files (JSON lines, or gzipped: .gz), in time order."""
    marks = []
    for p in paths:
        with (gzip.open(p, "rt") if str(p).endswith(".gz") else open(p)) as f:
            marks += [json.loads(line) for line in f if line.strip()]
    return sorted(marks, key=lambda m: m["t"])


class PhaseClock:
    """Host seconds of one step's phases, each less what `aside()` (a running total of seconds, e.g. the drafter's)
    grew by inside it: that time is a phase of its own, counted where it is kept."""

    def __init__(self, aside: Callable[[], float]):
        self.aside = aside
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        aside, start = self.aside(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = (self.seconds.get(name, 0.0) + time.perf_counter() - start
                                  - (self.aside() - aside))

    def move(self, seconds: float, source: str, target: str) -> None:
        """`seconds` of phase `source` were spent on `target`'s work."""
        self.seconds[source] = self.seconds.get(source, 0.0) - seconds
        self.seconds[target] = self.seconds.get(target, 0.0) + seconds
