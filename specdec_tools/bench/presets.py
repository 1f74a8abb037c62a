"""The named matrices of `specdec bench` (presets: full, baseline, quick, adaptive, long, multiturn) built from
workloads.py's Workload, and the CLI's filters over them (select)."""
from __future__ import annotations

import itertools
from dataclasses import replace

from .workloads import FORCED_LENGTHS, K, PATHS, Workload

DRAFTERS = [("none", None), ("ngram", None), ("mtp", None)] + [("mtp", a) for a in FORCED_LENGTHS]


def matrix(paths, drafters, concurrencies, prompts, temperatures, max_tokens) -> list[Workload]:
    """Cartesian product, ordered so that gateway workloads sharing a stack are adjacent."""
    out = []
    for path in paths:
        path_drafters = [("none", None)] if path == "peer" else drafters
        path_drafters = [d for d in path_drafters if d[0] != "none"] if path == "colocated" else path_drafters
        for (drafter, forced), prompt, temp, c in itertools.product(path_drafters, prompts, temperatures,
                                                                    concurrencies):
            out.append(Workload(path, drafter, c, prompt, max_tokens, temp, forced))
    return out


def full() -> list[Workload]:
    """The issue's matrix: concurrency 1/4/16/64, prompt 128/2048, 256 output tokens, greedy and T = 0.8,
    drafters none / ngram / mtp (its own acceptance, and forced to 1.5 / 2.5 / 3.39) at k = 3, three paths."""
    return matrix(PATHS, DRAFTERS, (1, 4, 16, 64), (128, 2048), (0.0, 0.8), 256)


BASELINE_OUT = 64
BASELINE_CUT = [
    "output tokens 256 -> 64 everywhere",
    "gateway path: drafters none and mtp@3.39 only, concurrency 1 and 16, prompt 128, greedy; colocated: "
    "mtp@3.39 at the same points",
    "in-process ngram, mtp@1.5 and mtp@2.5: concurrency 1 and 16, prompt 128, greedy only",
    "concurrency 4: in-process none and mtp@3.39, and the peer; concurrency 64: in-process none and mtp@3.39 "
    "(prompt 128, greedy), and the peer",
    "T = 0.8: in-process none and mtp@3.39 at concurrency 16 only",
    "prompt 2048: in-process none and mtp@3.39 at concurrency 1 only",
    "the peer: prompt 128, greedy only",
]


def baseline() -> list[Workload]:
    """A subset of full() sized for one 9-minute GPU call on today's eager path (about 20 tok/s at batch 1,
    100 tok/s at batch 16); BASELINE_CUT says what is left out. Ordered by priority: a time budget that runs
    out skips the tail (concurrency 64 and prompt 2048 last)."""
    o = BASELINE_OUT
    plain, mtp = ("none", None), ("mtp", 3.39)

    def w(path, d, c, prompt=128, temp=0.0):
        return Workload(path, d[0], c, prompt, o, temp, d[1])
    core = [w("inproc", d, c) for d in (plain, mtp) for c in (1, 16)]
    core += [w("peer", plain, c) for c in (1, 16)]
    core += [w("gateway", d, c) for d in (plain, mtp) for c in (1, 16)]
    core += [w("colocated", mtp, c) for c in (1, 16)]
    more = [w("inproc", d, c) for d in (("ngram", None), ("mtp", 1.5), ("mtp", 2.5)) for c in (1, 16)]
    more += [w("inproc", d, 4) for d in (plain, mtp)] + [w("peer", plain, c) for c in (4, 64)]
    more += [w("inproc", d, 16, temp=0.8) for d in (plain, mtp)]
    more += [w("inproc", d, 1, prompt=2048) for d in (plain, mtp)]
    more += [w("inproc", d, 64) for d in (plain, mtp)]
    return core + more


QUICK_CUT = ["CPU smoke run on the demo model: prompt 32, 12 output tokens, concurrency 1 and 4, "
             "drafters none and mtp@2.5 (ngram in-process only; colocated at concurrency 1 only), greedy "
             "(one T = 0.8 run)"]


def quick() -> list[Workload]:
    """A CPU smoke run of every path (CI runs it): demo model, small shapes."""
    o, p = 12, 32
    out = [Workload("inproc", d, c, p, o, 0.0, a) for d, a in (("none", None), ("mtp", 2.5)) for c in (1, 4)]
    out += [Workload("inproc", "ngram", 4, p, o), Workload("inproc", "mtp", 4, p, o, 0.8, 2.5)]
    out += [Workload("peer", "none", c, p, o) for c in (1, 4)]
    out += [Workload("gateway", "mtp", c, p, o, 0.0, 2.5) for c in (1, 4)]
    out += [Workload("colocated", "mtp", 1, p, o, 0.0, 2.5)]
    return out


SYNTHETIC_RATES = (0.3, 0.9)


def length_of_rate(rate: float, k: int = K) -> float:
    """The mean acceptance length of k drafts each accepted with probability `rate` while the ones before were."""
    return sum(rate ** j for j in range(k + 1))


def adaptive() -> list[Workload]:
    """Issue 41's matrix: the fixed and the adaptive draft policy against plain decoding, inproc, concurrency
    1 / 16 / 64, prompt 128, 256 greedy tokens; the synthetic drafter at per-token acceptance 0.3 and 0.9 and the
    MTP drafter forced to 1.5 and 3.39."""
    drafters = [("synthetic", length_of_rate(a), a) for a in SYNTHETIC_RATES] + [("mtp", a, None) for a in (1.5, 3.39)]
    out = []
    for c in (1, 16, 64):
        out.append(Workload("inproc", "none", c, 128, 256))
        out += [Workload("inproc", d, c, 128, 256, forced_length=f, accept_rate=a, draft_policy=p)
                for d, f, a in drafters for p in ("fixed", "adaptive")]
    return out


LONG_PROMPTS = (2048, 8192, 16384, 32768, 131072)
INTERFERING_PROMPT = 16384
CROWD = (64, 8192)     # requests at once and prompt tokens each: what the caches must hold without refusing one


def long_context() -> list[Workload]:
    """Issue 38's long-context matrix, through the gateway, greedy: one request per prompt length (TTFT, prefill
    tokens/s, MFU; 16 output tokens), then 15 decoders (prompt 128, 512 tokens) joined by one 16k-token prompt once
    they decode, without a drafter and with MTP forced to 3.39 (the decoders' ITL before and while it prefills,
    its TTFT against its TTFT alone), then CROWD[0] requests of CROWD[1] prompt tokens at once (what the caches
    must hold without refusing one). The MTP stack first, then one stack without a drafter, the longest prompt
    last (a time budget that runs out skips it)."""
    mixed = [Workload("gateway", d, 16, 128, 512, forced_length=f, long_prompt=INTERFERING_PROMPT)
             for d, f in (("mtp", 3.39), ("none", None))]
    crowd = [Workload("gateway", "none", CROWD[0], CROWD[1], 64)]
    return mixed + crowd + [Workload("gateway", "none", 1, p, 16) for p in LONG_PROMPTS]


MULTITURN = {"conversations": 16, "turns": 8, "system_tokens": 4096, "turn_tokens": 200, "max_tokens": 128}


def multiturn() -> list[Workload]:
    """Issue 39's prefix-cache workload, through the gateway, greedy: 16 conversations at once, each 8 turns in
    order; a 4096-token system prompt shared by all, 200 new user tokens a turn, 128 tokens back. Without a drafter,
    with MTP forced to 3.39, and with MTP at its own acceptance (a trained checkpoint's: with and without the
    cache it must be the same); one stack each."""
    m = MULTITURN
    return [Workload("gateway", d, m["conversations"], m["system_tokens"], m["max_tokens"], forced_length=f,
                     turns=m["turns"], turn_tokens=m["turn_tokens"])
            for d, f in (("none", None), ("mtp", 3.39), ("mtp", None))]


PRESETS = {"full": (full, []), "baseline": (baseline, BASELINE_CUT), "quick": (quick, QUICK_CUT),
           "adaptive": (adaptive, []), "long": (long_context, []), "multiturn": (multiturn, [])}


def select(workloads: list[Workload], paths=None, drafters=None, concurrencies=None, prompts=None,
           temperatures=None, max_tokens: int | None = None, draft_vocab: str | None = None,
           no_prefix_cache: bool = False, turns: int | None = None, turn_tokens: int | None = None,
           system_tokens: int | None = None, own_system_prompts: bool = False) -> list[Workload]:
    """Keep the workloads matching every given filter; max_tokens replaces the output length (of every turn) and
    turns / turn_tokens / system_tokens / own_system_prompts (each conversation a system prompt of its own) the
    conversations' shape; with draft_vocab every mtp workload kept gets a
    twin drafting over that file's ids (label +dv); with no_prefix_cache every gateway / colocated workload gets a
    twin on a verifier without its prefix cache (label +nocache), run after the workloads of its stack. A drafter
    filter keeps a label and the labels it prefixes (mtp@3.39 keeps mtp@3.39+dv+nocache)."""
    if draft_vocab:
        workloads = [v for w in workloads
                     for v in ((w, replace(w, draft_vocab=draft_vocab)) if w.drafter == "mtp" else (w,))]
    if no_prefix_cache:
        workloads = _with_twins(workloads, lambda w: replace(w, prefix_cache=False) if w.on_stack else None)
    keep = [w for w in workloads
            if (not paths or w.path in paths)
            and (not drafters or not drafters_prefixes(w.drafter_label).isdisjoint(drafters))
            and (not concurrencies or w.concurrency in concurrencies)
            and (not prompts or w.prompt_tokens in prompts)
            and (not temperatures or w.temperature in temperatures)]
    if max_tokens:
        keep = [replace(w, max_tokens=max_tokens) for w in keep]
    shape = {k: v for k, v in (("turns", turns), ("turn_tokens", turn_tokens), ("prompt_tokens", system_tokens),
                               ("shared_system", False if own_system_prompts else None)) if v is not None}
    keep = [replace(w, **shape) if w.turns and shape else w for w in keep]
    return list(dict.fromkeys(keep))


def drafters_prefixes(label: str) -> set[str]:
    """mtp@3.39+dv+nocache -> {mtp@3.39, mtp@3.39+dv, mtp@3.39+dv+nocache}: what a --drafters filter matches."""
    parts = label.split("+")
    return {"+".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _with_twins(workloads: list[Workload], twin) -> list[Workload]:
    """The workloads with the twins (twin(w); None: no twin) of each stack's workloads right after that stack's last
    one: a twin's stack starts once, after its original's."""
    last = {w.stack_key: i for i, w in enumerate(workloads)}
    out: list[Workload] = []
    for i, w in enumerate(workloads):
        out.append(w)
        if last[w.stack_key] == i:
            out += [t for t in (twin(g) for g in workloads if g.stack_key == w.stack_key) if t is not None]
    return out
