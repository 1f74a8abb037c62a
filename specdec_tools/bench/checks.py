"""Consistency of a bench result: the identities its numbers must satisfy. The bench runs these on its own
output and records what fails under "problems"; the CI smoke test asserts there are none.

    completion tokens = verify steps + accepted drafts + prefills   (one token per prefill, 1 + accepted per
                                                                     verify step; ignore_eos, no stop strings)
    mean acceptance length = (completion - prefills) / verify steps
    accepted <= drafted <= k · verify steps; no drafts without a drafter; mean drafts = drafted / verify steps
    tokens/s = tokens / seconds; TTFT <= seconds; p50 <= p99
    in-process step split: target + sampling + drafter round trip + host = step total
    every measured number > 0 (counts that may be 0: ZERO_OK)
    conversations: one request per turn (the counts above per request, not per stream); per group of turns, the
    usage's prompt tokens = the prompt tokens sent, cached <= prompt tokens, hit rate = cached / prompt tokens
"""
from __future__ import annotations

import math

from specdec_tools.bench.latency import SECONDS_DIGITS

ZERO_OK = {"draft_tokens", "accepted_tokens", "preemptions", "decode_steps", "mean_drafts", "cached_tokens", "hit_rate",
           "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "left_drafter"}
ZERO_OK_UNDER = ("steps_by_k",  # steps per chosen k: a fixed policy never chooses most k
                 "drafts")      # step_costs_ms.drafts: what a verify step had while timed, 0 in the k = 0 column


def may_be_zero(key: str) -> bool:
    """A dotted key (numbers()) whose value may be 0."""
    parts = key.split(".")
    return parts[-1] in ZERO_OK or any(p in parts[:-1] for p in ZERO_OK_UNDER)


def _close(a: float, b: float, rel: float = 1e-3, abs_: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def _rate_matches(rate: float, tokens: int, seconds: float) -> bool:
    """rate == tokens / seconds, where seconds was rounded to SECONDS_DIGITS places and rate to 3: a short run's
    rounded seconds moves the quotient by more than any fixed relative tolerance."""
    half_step = 0.5 * 10.0 ** -SECONDS_DIGITS
    low, high = tokens / (seconds + half_step), tokens / max(seconds - half_step, 1e-12)
    return low - 1e-3 <= rate <= high + 1e-3


def numbers(obj, prefix: str = ""):
    """(dotted key, value) of every int / float inside obj (bools excluded)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from numbers(v, f"{prefix}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numbers(v, f"{prefix}{i}.")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix.rstrip("."), obj


def check_result(result: dict, constrained: bool = False) -> list[str]:
    """Problems with one result ({"workload", "metrics", "bandwidth"}), as sentences naming the field.
    `constrained`: the requests had a grammar, which may end them before max_tokens."""
    w, m = result["workload"], result["metrics"]
    name = result.get("name", w.get("path"))
    if not m.get("prefills") and m.get("first_error"):   # nothing ran: one line saying why, not every zero
        return [f"{name}: no request was served: {m['first_error']}"]
    problems = [f"{name}: {key} = {v} is not > 0" for key, v in numbers({"metrics": m, "bw": result["bandwidth"]})
                if not v > 0 and not may_be_zero(key)]
    requests = w.get("requests", w["concurrency"])   # (conversations: a request per turn)
    expected = requests * w["max_tokens"]
    if not m["truncated"]:
        if m["completion_tokens"] != expected and not (constrained and 0 < m["completion_tokens"] < expected):
            problems.append(f"{name}: completion_tokens {m['completion_tokens']} != "
                            f"{'requests' if w.get('turns') else 'concurrency'} x max_tokens {expected}")
        if m["output_tokens"] != m["completion_tokens"]:
            problems.append(f"{name}: tokens received {m['output_tokens']} != completion_tokens "
                            f"{m['completion_tokens']}")
    if m["seconds"] > 0 and not _rate_matches(m["output_tokens_per_s"], m["output_tokens"], m["seconds"]):
        problems.append(f"{name}: output_tokens_per_s {m['output_tokens_per_s']} != tokens / seconds")
    if m["ttft_ms_p50"] is not None and m["ttft_ms_p50"] > m["seconds"] * 1e3 + 1e-6:
        problems.append(f"{name}: ttft_ms_p50 {m['ttft_ms_p50']} exceeds the workload's {m['seconds']} s")
    for a, b in (("ttft_ms_p50", "ttft_ms_p99"), ("itl_ms_p50", "itl_ms_p99")):
        if m[a] is not None and m[b] is not None and m[a] > m[b] + 1e-9:
            problems.append(f"{name}: {a} {m[a]} > {b} {m[b]}")
    if w["path"] != "peer":
        problems += _check_speculation(name, w, m)
    if w["path"] == "inproc" and m["step_ms"].get("decode_steps"):
        problems += _check_split(name, m["step_ms"])
    if m.get("multiturn"):
        problems += _check_turns(name, m["multiturn"], m["truncated"])
    return problems


def _check_turns(name: str, f: dict, truncated: bool) -> list[str]:
    problems = []
    for group in ("turn_1", "later", "all"):
        g = f.get(group)
        if not g:
            continue
        if not truncated and g["usages"] == g["requests"] and g["prompt_tokens"] != g["prompt_tokens_sent"]:
            problems.append(f"{name}: {group}: usage prompt_tokens {g['prompt_tokens']} != prompt tokens sent "
                            f"{g['prompt_tokens_sent']}")
        if g["cached_tokens"] is not None and g["cached_tokens"] > g["prompt_tokens"]:
            problems.append(f"{name}: {group}: cached_tokens {g['cached_tokens']} > prompt_tokens "
                            f"{g['prompt_tokens']}")
        if g["hit_rate"] is not None and not _close(g["hit_rate"], g["cached_tokens"] / g["prompt_tokens"], 0, 1e-4):
            problems.append(f"{name}: {group}: hit_rate {g['hit_rate']} != cached_tokens / prompt_tokens")
    first, later = f.get("turn_1"), f.get("later")
    if later and f.get("ttft_p50_ratio") is not None and not _close(
            f["ttft_p50_ratio"], later["ttft_ms_p50"] / first["ttft_ms_p50"], 1e-3):
        problems.append(f"{name}: ttft_p50_ratio {f['ttft_p50_ratio']} != later / turn 1 TTFT p50")
    return problems


def _check_speculation(name: str, w: dict, m: dict) -> list[str]:
    problems = []
    verify, accepted, drafted, prefills = m["verify_steps"], m["accepted_tokens"], m["draft_tokens"], m["prefills"]
    if not m["truncated"]:
        if m["completion_tokens"] != verify + accepted + prefills:
            problems.append(f"{name}: completion_tokens {m['completion_tokens']} != verify_steps {verify} + "
                            f"accepted_tokens {accepted} + prefills {prefills}")
        requests = w.get("requests", w["concurrency"])
        if prefills != requests:
            problems.append(f"{name}: prefills {prefills} != {'requests' if w.get('turns') else 'concurrency'} "
                            f"{requests}")
        if verify and not _close(m["mean_acceptance_length"], (m["completion_tokens"] - prefills) / verify, 1e-3):
            problems.append(f"{name}: mean_acceptance_length {m['mean_acceptance_length']} != "
                            f"(completion - prefills) / verify_steps")
    if accepted > drafted:
        problems.append(f"{name}: accepted_tokens {accepted} > draft_tokens {drafted}")
    if m.get("mean_drafts") is not None and verify and not _close(m["mean_drafts"], drafted / verify, 1e-3, 1e-4):
        problems.append(f"{name}: mean_drafts {m['mean_drafts']} != draft_tokens / verify_steps")
    if drafted > w["k"] * verify:
        problems.append(f"{name}: draft_tokens {drafted} > k x verify_steps {w['k'] * verify}")
    if w["drafter"] == "none" and drafted:
        problems.append(f"{name}: {drafted} draft tokens without a drafter")
    return problems


def _check_split(name: str, split: dict) -> list[str]:
    parts = sum(split[k] or 0.0 for k in ("target_forward", "sampling", "drafter_round_trip", "host"))
    if not _close(parts, split["total"], 0.02, 1e-3):
        return [f"{name}: step split {parts:.4f} ms != step total {split['total']:.4f} ms"]
    return []


def check_all(results: list[dict], constrained: bool = False) -> list[str]:
    return [p for r in results for p in check_result(r, constrained)]
