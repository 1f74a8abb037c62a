"""Where a piece of code synchronises the host with the GPU: torch's sync debug mode warns at every synchronising
call (`.tolist()`, pageable copies, ...); each warning's stack is kept, cut to this repository's own frames."""
from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = str(Path(__file__).resolve().parents[2])


def synchronising_stacks(run: Callable[[], object], times: int = 1) -> list[list[traceback.FrameSummary]]:
    """Call `run` `times` times under sync debug mode; one list of repository frames (outermost first, tests/
    left out) per synchronising call. CUDA only."""
    stacks = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):   # torch's words: "called a synchronizing CUDA operation"
            return
        stacks.append([f for f in traceback.extract_stack()[:-1]
                       if f.filename.startswith(REPO_ROOT) and "/tests/" not in f.filename])

    torch.cuda.set_sync_debug_mode(1)   # before recording: setting it warns once per process ("prototype")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(times):
                run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return stacks


def site(frames: list[traceback.FrameSummary], depth: int = 1) -> str:
    """`file:line` of the innermost repository frame, with `depth` - 1 callers after it ("?" for none)."""
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-depth:])) or "?"
