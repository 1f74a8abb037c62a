"""A served process's start-up heap, out of the garbage collector's way.

A full (generation 2) collection traverses every container object alive, and stops every thread of the process
while it does: in a service that has loaded torch, Triton and a model, hundreds of thousands of objects. Each one
in a drafter service is a step the verifier waits for (`specdec bench --trace-steps` shows them).

`gc.freeze()` moves every object alive into a permanent generation that collections skip, so a full collection
while serving traverses only what serving created. It runs once the service is loaded and warmed up; garbage
left by the start-up is collected first, so none of it is kept for the life of the process.

What it does not cover, on purpose: an MTP drafter service builds its head, KV cache and graphs when a verifier
attaches, after the freeze, and those stay collectable, so a verifier that re-attaches frees the old ones. A
frozen object in a reference cycle is never freed: the one such case known is the verifier's first link to a
drafter, when it connected before the freeze, which a reconnect then leaves behind once (a bounded cost; the
link keeps its replaced CUDA buffers for the last 8 reconnects anyway).
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(service: str) -> int:
    """Collect the start-up's garbage, then freeze what is alive; returns the number of objects frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d objects of the start-up heap frozen in %.0f ms: garbage collections while serving skip them",
             service, frozen, (time.perf_counter() - start) * 1e3)
    return frozen
