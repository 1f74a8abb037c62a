"""What a bench run leaves behind: the JSON record, a text table (printed and saved) and a PNG plot of
output tokens/s against concurrency, one line per path and drafter, the peer included. Conversation workloads
(preset multiturn) add a second table: TTFT of the first turns against the later ones, and the prefix cache's hit
rate."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

COLUMNS = ["path", "drafter", "c", "prompt", "out", "T", "tok/s", "x plain", "x peer", "TTFT p50", "ITL p50",
           "ITL p99", "acc len", "k", "step ms", "tgt", "samp", "drf rt", "drf cmp", "host", "mem MiB", "BW/copy",
           "BW/chain"]


def write_json(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)   # a partial record survives a run that is cut off


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


MULTITURN_COLUMNS = ["path", "drafter", "conv", "turns", "system", "user", "out", "T", "tok/s", "TTFT1 p50",
                     "TTFT1 p90", "TTFT2+ p50", "TTFT2+ p90", "2+/1", "hit 1", "hit 2+", "hit all", "acc len"]


def _key(r: dict, drafter: str | None = None, path: str | None = None) -> tuple:
    w = r["workload"]
    return (path or w["path"], drafter or w["drafter_label"], w["concurrency"], w["prompt_tokens"], w["temperature"],
            w.get("turns", 0), w.get("turn_tokens", 0), w.get("shared_system", True))


def _plain(w: dict) -> str:
    """The drafter label of w's plain-decoding row: none (none+nocache beside a verifier without its prefix cache)."""
    return "none" if w.get("prefix_cache", True) else "none+nocache"


def _prompt(w: dict) -> str:
    """The prompt column: its tokens; a conversation's system prompt + turns x user tokens ("own 4096+8x200": each
    conversation a system prompt of its own)."""
    if w.get("turns"):
        own = "" if w.get("shared_system", True) else "own "
        return f"{own}{w['prompt_tokens']}+{w['turns']}x{w['turn_tokens']}"
    return str(w["prompt_tokens"])


def _memory_mib(m: dict) -> float | None:
    values = [v for v in (m.get("memory") or {}).values() if isinstance(v, (int, float))]
    return sum(values) if values else None


def table_rows(results: list[dict]) -> list[list[str]]:
    rate = {_key(r): r["metrics"]["output_tokens_per_s"] for r in results}
    rows = []
    for r in results:
        w, m, bw = r["workload"], r["metrics"], r["bandwidth"]
        tps = m["output_tokens_per_s"]
        plain = rate.get(_key(r, drafter=_plain(w), path="gateway" if w["path"] == "colocated" else None))
        peer = rate.get(_key(r, drafter="none", path="peer"))
        split = m.get("step_ms") or {}
        rows.append([w["path"], w["drafter_label"], str(w["concurrency"]), _prompt(w),
                     str(w["max_tokens"]) + ("*" if m["truncated"] else ""), f"{w['temperature']:g}", _fmt(tps),
                     _fmt(tps / plain if tps and plain else None, 2), _fmt(tps / peer if tps and peer else None, 2),
                     _fmt(m["ttft_ms_p50"]), _fmt(m["itl_ms_p50"]), _fmt(m["itl_ms_p99"]),
                     _fmt(m.get("mean_acceptance_length"), 2), _fmt(m.get("mean_drafts"), 2), _fmt(split.get("total")),
                     _fmt(split.get("target_forward")), _fmt(split.get("sampling")),
                     _fmt(split.get("drafter_round_trip")), _fmt(split.get("drafter_compute")), _fmt(split.get("host")),
                     _fmt(_memory_mib(m), 0), _percent(bw["vs_copy"]), _percent(bw["vs_chain"])])
    return rows


def long_context_lines(results: list[dict]) -> list[str]:
    """The long-context workloads (preset long): each lone prompt's prefill (TTFT, tokens/s, TFLOP/s, MFU), and
    each interference run: the long prompt's TTFT (against the same prompt alone) and the decoders' ITL p50 / p99
    / max before it was sent and while it prefilled."""
    lines, alone = [], {}
    for r in results:
        w, p = r["workload"], r.get("prefill")
        if p and w["prompt_tokens"] >= 1024:
            alone[w["prompt_tokens"]] = r["metrics"]["ttft_ms_p50"]
            mfu = f", MFU {100 * p['mfu']:.1f}%" if p.get("mfu") is not None else ""
            lines.append(f"prefill {w['prompt_tokens']} tokens ({w['drafter_label']}): TTFT "
                         f"{r['metrics']['ttft_ms_p50']} ms, {p['tokens_per_s']:.0f} tokens/s, "
                         f"{p['tflops']} TFLOP/s{mfu}")
    for r in results:
        w, f = r["workload"], r["metrics"].get("interference")
        if not f or f.get("long_ttft_ms") is None:
            continue
        b, d = f["decoders_itl_ms_before"], f["decoders_itl_ms_during"]
        base = alone.get(w["long_prompt"])
        vs = f" = {f['long_ttft_ms'] / base:.2f}x its TTFT alone" if base else ""
        ratio = f" (p99 {d['p99'] / b['p99']:.2f}x)" if b["p99"] and d["p99"] else ""
        lines.append(f"interference ({w['drafter_label']}, {w['concurrency'] - 1} decoders + one "
                     f"{w['long_prompt']}-token prompt): its TTFT {f['long_ttft_ms']} ms{vs}; decoders' ITL p50 / "
                     f"p99 / max before {b['p50']} / {b['p99']} / {b['max']} ms, while it prefills {d['p50']} / "
                     f"{d['p99']} / {d['max']} ms{ratio}")
    seen = set()   # the services' start-up cache sizes (logged by each stack), once each
    for r in results:
        for line in r["metrics"].get("service_caches", ()):
            if line not in seen:
                seen.add(line)
                lines.append(f"{r['workload']['drafter_label']} stack: {line}")
    return lines


def multiturn_rows(results: list[dict]) -> list[list[str]]:
    """One row per conversation workload: tok/s, TTFT p50 / p90 of the first turns and of the later ones (ms),
    later p50 / first p50, the prefix cache's hit rate (cached / prompt tokens) of each and overall, acc len."""
    rows = []
    for r in results:
        w, m = r["workload"], r["metrics"]
        f = m.get("multiturn")
        if not f:
            continue
        first, later, total = f["turn_1"], f.get("later") or {}, f["all"]
        turns = str(w["turns"]) + ("*" if m["truncated"] else "")
        system = ("" if w.get("shared_system", True) else "own ") + str(w["prompt_tokens"])
        rows.append([w["path"], w["drafter_label"], str(w["concurrency"]), turns, system,
                     str(w["turn_tokens"]), str(w["max_tokens"]), f"{w['temperature']:g}",
                     _fmt(m["output_tokens_per_s"]), _fmt(first["ttft_ms_p50"]), _fmt(first["ttft_ms_p90"]),
                     _fmt(later.get("ttft_ms_p50")), _fmt(later.get("ttft_ms_p90")), _fmt(f["ttft_p50_ratio"], 3),
                     _percent(first["hit_rate"]), _percent(later.get("hit_rate")), _percent(total["hit_rate"]),
                     _fmt(m.get("mean_acceptance_length"), 2)])
    return rows


def prefix_cache_lines(results: list[dict]) -> list[str]:
    """Each conversation workload against its twin without the prefix cache (+nocache): the later turns' TTFT p50
    and tokens/s of both."""
    rows = {_key(r): r["metrics"] for r in results if r["metrics"].get("multiturn")}
    lines = []
    for r in results:
        w, m = r["workload"], r["metrics"]
        if not m.get("multiturn") or not w.get("prefix_cache", True):
            continue
        twin = rows.get(_key(r, drafter=w["drafter_label"] + "+nocache"))
        ttft, other = (m["multiturn"].get("later") or {}).get("ttft_ms_p50"), \
            ((twin or {}).get("multiturn", {}).get("later") or {}).get("ttft_ms_p50")
        if twin is None or not ttft or not other or not m["output_tokens_per_s"] or not twin["output_tokens_per_s"]:
            continue
        change = 100 * (m["output_tokens_per_s"] / twin["output_tokens_per_s"] - 1)
        lines.append(f"prefix cache, {w['drafter_label']} c{w['concurrency']}: TTFT p50 of turns >= 2 {ttft:.1f} ms "
                     f"against {other:.1f} ms without it ({ttft / other:.2f}x); {m['output_tokens_per_s']:.1f} "
                     f"against {twin['output_tokens_per_s']:.1f} tok/s ({change:+.1f}%)")
    return lines


def _table(columns: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + \
            ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    return ["  ".join(c.rjust(wd) for c, wd in zip(columns, widths))] + \
        ["  ".join(v.rjust(wd) for v, wd in zip(r, widths)) for r in rows]


def split_lines(results: list[dict]) -> list[str]:
    """What the service split costs: each gateway row against the colocated row of the same drafter and
    workload (tokens/s of the median pass each), with the range of each path's timed passes."""
    colocated = {_key(r, path="gateway"): r["metrics"] for r in results if r["workload"]["path"] == "colocated"}
    lines = []
    for r in results:
        w, m = r["workload"], r["metrics"]
        twin = colocated.get(_key(r)) if w["path"] == "gateway" else None
        if twin is None or not m["output_tokens_per_s"] or not twin["output_tokens_per_s"]:
            continue
        change = 100 * (m["output_tokens_per_s"] / twin["output_tokens_per_s"] - 1)
        lines.append(f"service split, {w['drafter_label']} c{w['concurrency']} T={w['temperature']:g}: gateway "
                     f"{m['output_tokens_per_s']:.1f} against colocated {twin['output_tokens_per_s']:.1f} tok/s, "
                     f"{change:+.1f}% (passes {_range(m)} against {_range(twin)})")
    return lines


def _range(metrics: dict) -> str:
    passes = metrics.get("passes_tokens_per_s") or [metrics["output_tokens_per_s"]]
    return f"{min(passes):.0f}-{max(passes):.0f}"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render_table(record: dict, markdown: bool = False) -> str:
    rows = table_rows(record["results"])
    roof = record.get("roofline") or {}
    copy, chain = roof.get("device_copy", {}), roof.get("weight_chain", {})
    head = (f"specdec bench ({record['preset']}) on {record['device']['name']}: model {record['model']['name']} "
            f"({record['model']['layers']} layers, {record['model']['weight_gb']:.3g} GB {record['model']['dtype']}); "
            f"device copy {copy.get('gbs', '-')} GB/s, weight-GEMM chain {chain.get('ms_1_token', '-')} ms "
            f"({chain.get('gbs', '-')} GB/s); ms per step; * = cut by the time guard")
    settings = record.get("settings", {})
    if settings.get("tensor_parallel_size", 1) > 1:
        head += f"; tensor parallel {settings['tensor_parallel_size']} (BW per GPU)"
    if settings.get("load_format") == "dummy":
        head += "; dummy (random) weights"
    if settings.get("quantization", "none") != "none":
        head += f"; --quantization {settings['quantization']} (the GB count its linears at a byte a weight)"
    if settings.get("prefill_chunk"):
        head += f"; prefill chunks of {settings['prefill_chunk']} tokens"
    if settings.get("lone_prefill_chunk"):
        head += f"; prompt chunks of {settings['lone_prefill_chunk']}+ tokens alone, in turns"
    if settings.get("service_defaults"):
        head += "; the services' default limits and cache sizes"
    for service in ("verifier", "drafter"):
        if settings.get(f"{service}_args"):
            head += f"; {service} {' '.join(settings[f'{service}_args'])}"
    if settings.get("grammar"):
        head += f"; every request constrained by a {settings['grammar']} grammar"
        if any(r.get("workload", {}).get("drafter") == "mtp" for r in record.get("results", [])):
            head += f" (mtp draft masks {settings.get('draft_masks', 'auto')})"
    lines = _table(COLUMNS, rows, markdown)
    turns = multiturn_rows(record["results"])
    if turns:   # (TTFT in ms; 2+/1: the later turns' TTFT p50 over the first turns'; hit: cached / prompt tokens)
        lines += ["", "conversations: TTFT ms of turn 1 and of turns >= 2, 2+/1 = their p50 ratio; hit = the prefix "
                      "cache's cached / prompt tokens (usage)"] + _table(MULTITURN_COLUMNS, turns, markdown)
    tail = split_lines(record["results"]) + prefix_cache_lines(record["results"]) \
        + long_context_lines(record["results"])
    tail += [f"skipped {s['name']}: {s['reason']}" for s in record.get("skipped", [])]
    tail += [f"PROBLEM {p}" for p in record.get("problems", [])]
    return "\n".join([head, *lines, *tail])


PATH_STYLE = {"inproc": "-", "gateway": ":", "colocated": "-.", "peer": "--"}
DRAFTER_COLOURS = {"none": "tab:gray", "ngram": "tab:green", "mtp@1.5": "tab:orange", "mtp@2.5": "tab:red",
                   "mtp@3.39": "tab:purple", "mtp": "tab:blue"}


def _colour(drafter: str) -> str:
    return DRAFTER_COLOURS.get(drafter, "tab:brown")


def _panel(w: dict) -> tuple:
    return (w["prompt_tokens"], w["temperature"], w.get("turns", 0), w.get("turn_tokens", 0))


def plot(record: dict, path: Path) -> Path | None:
    """tokens/s vs concurrency: one panel per (prompt, temperature), one line per path + drafter."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'specdec[bench]'): no plot")
        return None
    results = record["results"]
    panels = sorted({_panel(r["workload"]) for r in results})
    if not panels:
        return None
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.8 * rows), squeeze=False)
    for ax, (prompt, temp, turns, user) in zip(axes.flat, panels):
        lines: dict[tuple, list] = {}
        for r in results:
            w = r["workload"]
            if _panel(w) == (prompt, temp, turns, user) and r["metrics"]["output_tokens_per_s"]:
                lines.setdefault((w["path"], w["drafter_label"]), []).append(
                    (w["concurrency"], r["metrics"]["output_tokens_per_s"]))
        for (p, d), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([c for c, _ in pts], [t for _, t in pts], PATH_STYLE[p], marker="o",
                    color="black" if p == "peer" else _colour(d),
                    label="peer: transformers generate" if p == "peer" else f"{p} {d}")
        ticks = sorted({c for pts in lines.values() for c, _ in pts})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("concurrency (streams)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"prompt {prompt}" + (f" + {turns} turns x {user}" if turns else "") + f", T = {temp:g}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"specdec bench ({record['preset']}), {record['device']['name']}, {record['model']['name']} "
                 f"({record['model']['layers']} layers)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
