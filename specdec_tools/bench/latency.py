"""Per-request delivery traces and the latency / throughput figures computed from them.

A trace holds, for one request, the time it was sent and each delivery (a time and how many tokens it carried).
One delivery per engine step: a speculative step may deliver several tokens at once.
    TTFT        first delivery - send
    ITL         gaps between consecutive deliveries of a request (one per step, as a streaming client sees them;
                vLLM's benchmark counts them the same way), pooled over requests: p50 / p99 / mean
    TPOT        (last delivery - first delivery) / (tokens - 1), per request, mean
    tokens/s    all output tokens / (last delivery of any request - first send)
Conversations (turn_figures): TTFT p50 / p90 of the first turns and of the later ones, their p50 ratio, and the
prefix cache's hit rate = sum of usage.cached_tokens / sum of usage.prompt_tokens, per group of turns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

SECONDS_DIGITS = 6  # a workload's seconds are kept to the microsecond; CPU smoke runs last a few ms


@dataclass
class RequestTrace:
    sent: float
    times: list[float] = field(default_factory=list)   # delivery times (perf_counter seconds)
    counts: list[int] = field(default_factory=list)    # tokens in each delivery
    error: str | None = None                            # the status that ended it, if one did ("CODE: details")

    def add(self, t: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.times.append(t)
            self.counts.append(num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list, None for an empty one."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median_pass(passes: list[dict]) -> tuple[dict, list[float]]:
    """Of a workload's timed passes, the one of median tokens/s, and every pass's tokens/s (rounded)."""
    rates = [p["output_tokens_per_s"] or 0.0 for p in passes]
    return passes[sorted(range(len(passes)), key=rates.__getitem__)[len(passes) // 2]], [round(r, 2) for r in rates]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def summarize(traces: list[RequestTrace]) -> dict:
    """Throughput and latency of one workload (ms, tokens/s); None where a figure has no data."""
    served = [t for t in traces if t.times]
    tokens = sum(t.num_tokens for t in served)
    start = min(t.sent for t in traces)
    end = max((t.times[-1] for t in served), default=start)
    ttft = [t.times[0] - t.sent for t in served]
    gaps = [b - a for t in served for a, b in zip(t.times, t.times[1:])]
    tpot = [(t.times[-1] - t.times[0]) / (t.num_tokens - 1) for t in served if t.num_tokens > 1]
    seconds = end - start
    return {
        "output_tokens": tokens,
        "seconds": round(seconds, SECONDS_DIGITS),
        "output_tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
        "ttft_ms_p50": _ms(percentile(ttft, 50)), "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "itl_ms_p50": _ms(percentile(gaps, 50)), "itl_ms_p99": _ms(percentile(gaps, 99)),
        "itl_ms_mean": _ms(sum(gaps) / len(gaps)) if gaps else None,
        "tpot_ms_mean": _ms(sum(tpot) / len(tpot)) if tpot else None,
        "deliveries": sum(len(t.times) for t in served),
    }


def interference(traces: list[RequestTrace]) -> dict:
    """The last trace is a long prompt sent while the others decode: its TTFT, and the others' gaps between
    deliveries before it was sent and while it prefilled (a gap that overlaps its prefill counts there)."""
    long, decoders = traces[-1], traces[:-1]
    if not long.times:
        return {"long_ttft_ms": None}
    start, end = long.sent, long.times[0]
    before = [b - a for t in decoders for a, b in zip(t.times, t.times[1:]) if b <= start]
    during = [b - a for t in decoders for a, b in zip(t.times, t.times[1:]) if b > start and a < end]

    def stats(gaps: list[float]) -> dict:
        return {"p50": _ms(percentile(gaps, 50)), "p99": _ms(percentile(gaps, 99)),
                "max": _ms(max(gaps)) if gaps else None, "gaps": len(gaps)}
    return {"long_ttft_ms": _ms(end - start), "decoders_itl_ms_before": stats(before),
            "decoders_itl_ms_during": stats(during)}


@dataclass
class TurnRecord:
    """One request of a conversation workload: its conversation, its turn (1-based), the prompt tokens sent, its
    deliveries, and how it ended (the finish reason or the gRPC status, and the usage of its last message)."""
    conversation: int
    turn: int
    prompt_tokens: int
    trace: RequestTrace
    finish_reason: str = "none"
    usage: object = None        # gateway_pb2.Usage (cached_tokens: the prompt tokens served by the prefix cache)


def _turn_group(records: list[TurnRecord]) -> dict:
    ttft = [r.trace.times[0] - r.trace.sent for r in records if r.trace.times]
    usages = [r.usage for r in records if r.usage is not None]
    prompt = sum(u.prompt_tokens for u in usages)
    cached = [getattr(u, "cached_tokens", None) for u in usages]     # (None: a gateway without the field)
    cached_sum = sum(cached) if usages and None not in cached else None
    return {"requests": len(records), "ttft_ms_p50": _ms(percentile(ttft, 50)),
            "ttft_ms_p90": _ms(percentile(ttft, 90)), "prompt_tokens_sent": sum(r.prompt_tokens for r in records),
            "usages": len(usages), "prompt_tokens": prompt, "cached_tokens": cached_sum,
            "hit_rate": round(cached_sum / prompt, 4) if cached_sum is not None and prompt else None}


def turn_figures(records: list[TurnRecord]) -> dict:
    """A conversation workload's figures: for the first turns (turn_1), the later ones (later: turns >= 2) and all,
    TTFT p50 / p90 (ms) and the prefix cache's hit rate (cached / prompt tokens, from each request's usage; None
    where the usage has no cached_tokens); the later turns' TTFT p50 over the first turns' (ttft_p50_ratio); and the
    same per turn (by_turn). later is None when no request has a later turn."""
    first = [r for r in records if r.turn == 1]
    later = [r for r in records if r.turn > 1]
    a, b = _turn_group(first), _turn_group(later) if later else None
    ratio = b["ttft_ms_p50"] / a["ttft_ms_p50"] if b and a["ttft_ms_p50"] and b["ttft_ms_p50"] is not None else None
    return {"turn_1": a, "later": b, "all": _turn_group(records),
            "ttft_p50_ratio": round(ratio, 4) if ratio is not None else None,
            "by_turn": [{"turn": t, **_turn_group([r for r in records if r.turn == t])}
                        for t in sorted({r.turn for r in records})]}
