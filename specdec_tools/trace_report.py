"""Where a step's wall time goes, from `--trace-steps` files of the verifier and the drafter (specdec.step_trace).

Every verifier mark without a link step belongs to the engine step it falls in (counted by "step.begin"); a
mark of the drafter link (`link.*` in the verifier, `drafter.*` in the drafter) carries the link's step counter
and belongs to the engine step that sent that message. One engine step then reads, in time order:

    forward.begin → forward.launched → verified → link.sent → link.taken → drafter.received → drafter.proposed
    → drafter.answered → link.answer → link.read → the next step's forward.begin

(link.read falls in the next engine step: the engine reads the answer at the start of it). Each segment's
median is taken over the steps that have both of its ends, per batch size (the sequences in forward.begin).
Then how long requests wait from "request.submitted" to a launch (admission_lines), and the garbage collections.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

# (label, (event, step offset), (event, step offset)): the critical path of one step, in order
FORWARD = [
    ("target forward: host launch", ("forward.begin", 0), ("forward.launched", 0)),
    ("target forward: GPU wait + sampling", ("forward.launched", 0), ("verified", 0)),
]
CHAIN = FORWARD + [
    ("commit, stop checks", ("verified", 0), ("committed", 0)),
    ("drafter inputs, hidden rows gathered", ("committed", 0), ("draft.inputs", 0)),
    ("step message built", ("draft.inputs", 0), ("link.message", 0)),
    ("hidden rows to the shared buffer, queued", ("link.message", 0), ("link.sent", 0)),
    ("step channel takes the message (gRPC thread)", ("link.sent", 0), ("link.taken", 0)),
    ("wire + drafter thread wakes", ("link.taken", 0), ("drafter.received", 0)),
    ("drafter: propose (its GPU work included)", ("drafter.received", 0), ("drafter.proposed", 0)),
    ("drafter: answer message", ("drafter.proposed", 0), ("drafter.answered", 0)),
    ("wire back + step channel reads it", ("drafter.answered", 0), ("link.answer", 0)),
    ("engine reads the answer", ("link.answer", 0), ("link.read", 0)),
    ("schedule, batch, drafts into it", ("link.read", 0), ("forward.begin", 1)),
]
PLAIN_CHAIN = FORWARD + [  # no drafter link: the step ends, outputs go out, the next one starts
    ("commit, stop checks", ("verified", 0), ("step.end", 0)),
    ("outputs to the streams", ("step.end", 0), ("outputs.delivered", 0)),
    ("next step: schedule, batch", ("outputs.delivered", 0), ("forward.begin", 1)),
]
ASIDE = [  # off the chain: what the engine does while the drafter drafts
    ("engine after sending: outputs to the streams", ("link.sent", 0), ("outputs.delivered", 0)),
    ("engine waits for the answer", ("step.begin", 1), ("link.read", 0)),
]
CYCLE = ("step (forward.begin to the next)", ("forward.begin", 0), ("forward.begin", 1))


@dataclass
class Segment:
    label: str
    median_ms: float
    p90_ms: float
    count: int


def served(marks: list[dict]) -> list[dict]:
    """The marks after the verifier's "serving" mark: its start-up warm-up (and the drafter's graph captures it
    causes) left out."""
    serving = [m["t"] for m in marks if m["event"] == "serving"]
    return [m for m in marks if m["t"] > serving[0]] if serving else marks


def by_engine_step(marks: list[dict]) -> tuple[dict[int, dict[str, float]], dict[int, int]]:
    """Time-ordered marks → ({engine step: {event: first time}}, {engine step: batch size}), from the marks
    `served` keeps."""
    marks = served(marks)
    steps: dict[int, dict[str, float]] = defaultdict(dict)
    batch: dict[int, int] = {}
    link_to_engine: dict[int, int] = {}            # link step → the engine step that sent it
    engine = -1
    for m in marks:
        event = m["event"]
        if m["process"] == "verifier" and m["step"] < 0:
            if event == "step.begin":
                engine += 1
            if engine < 0:
                continue
            steps[engine].setdefault(event, m["t"])
            if event == "forward.begin":
                batch[engine] = m.get("batch", 0)
            continue
        if m["process"] == "verifier":   # the link's first mark of a step is made while the engine sends it
            link_to_engine.setdefault(m["step"], engine)
        n = link_to_engine.get(m["step"])
        if n is not None and n >= 0:
            steps[n].setdefault(event, m["t"])
    return steps, batch


def _deltas(steps: dict[int, dict[str, float]], numbers: list[int], start, end) -> list[float]:
    (e0, o0), (e1, o1) = start, end
    out = []
    for n in numbers:
        a, b = steps.get(n + o0, {}).get(e0), steps.get(n + o1, {}).get(e1)
        if a is not None and b is not None and b >= a:
            out.append((b - a) * 1e3)
    return out


def segments(steps: dict[int, dict[str, float]], numbers: list[int]) -> list[Segment]:
    """The chain (spec or plain, whichever these steps ran), the asides and the whole step, for `numbers`."""
    spec = any("link.sent" in steps[n] for n in numbers)
    rows = (CHAIN + ASIDE if spec else PLAIN_CHAIN) + [CYCLE]
    out = []
    for label, start, end in rows:
        d = _deltas(steps, numbers, start, end)
        if d:
            p90 = statistics.quantiles(d, n=10)[-1] if len(d) > 1 else d[0]
            out.append(Segment(label, statistics.median(d), p90, len(d)))
    return out


def report(marks: list[dict], min_steps: int = 20) -> str:
    """A table per batch size seen in at least `min_steps` steps."""
    steps, batch = by_engine_step(marks)
    sizes: dict[int, list[int]] = defaultdict(list)
    for n, b in batch.items():
        sizes[b].append(n)
    lines = []
    for b in sorted(sizes):
        numbers = sizes[b]
        if len(numbers) < min_steps:
            continue
        lines.append(f"batch {b}: {len(numbers)} steps")
        lines.append(f"  {'segment':<48} {'median ms':>10} {'p90 ms':>8} {'steps':>6}")
        for s in segments(steps, numbers):
            lines.append(f"  {s.label:<48} {s.median_ms:>10.3f} {s.p90_ms:>8.3f} {s.count:>6}")
    lines += admission_lines(marks) + collection_lines(marks)
    return "\n".join(lines) if lines else f"no batch size has {min_steps} traced steps"


def collection_lines(marks: list[dict]) -> list[str]:
    """Per process: its garbage collections while serving ("gc.start" / "gc.stop" marks after `served`), by
    generation, with their pauses."""
    started: dict[str, float] = {}
    pauses: dict[tuple[str, int], list[float]] = defaultdict(list)
    for m in served(marks):
        if m["event"] == "gc.start":
            started[m["process"]] = m["t"]
        elif m["event"] == "gc.stop" and m["process"] in started:
            pauses[(m["process"], m.get("batch", 0))].append((m["t"] - started.pop(m["process"])) * 1e3)
    lines = [f"  {process} gc gen {gen}: {len(d)} collections, {sum(d):.1f} ms in all, longest {max(d):.2f} ms"
             for (process, gen), d in sorted(pauses.items())]
    return ["garbage collections (every thread of the process waits):"] + lines if lines else []


def admission_lines(marks: list[dict]) -> list[str]:
    """Requests handed to the engine while serving ("request.submitted") and the time until the launch of the
    first engine step that begins after each ("forward.launched" after a later "step.begin"; a step that launches
    nothing, e.g. one that only reads the last step, passes them on): the host's work before a new request's first
    chunk can run (the step in hand, scheduling, prefix matching, staging, the launch), or until the next launch if
    that step had no room for it. Median, p90 and max."""
    waits, waiting, began = [], [], None
    for m in served(marks):
        if m["process"] != "verifier" or m["step"] >= 0:
            continue
        if m["event"] == "request.submitted":
            waiting.append(m["t"])
        elif m["event"] == "step.begin":
            began = m["t"]
        elif m["event"] == "forward.launched" and began is not None:
            waits += [(m["t"] - t) * 1e3 for t in waiting if t < began]
            waiting = [t for t in waiting if t >= began]
    if not waits:
        return []
    p90 = statistics.quantiles(waits, n=10, method="inclusive")[-1] if len(waits) > 1 else waits[0]
    return [f"requests: {len(waits)} submitted; to the next step's launch: median {statistics.median(waits):.2f} "
            f"ms, p90 {p90:.2f} ms, max {max(waits):.2f} ms"]
