"""Token-mask cost of the two grammar engines, xgrammar and llguidance, at Qwen3.5's vocabulary size (issue 40).

No model hub here, so the tokenizer is synthetic (bench/synthetic_tokenizer.py) but a real byte-level BPE
(`tokenizers`, Qwen2's pre-tokenizer regex): the 256 bytes, then pieces of the Python standard library's sources as
that regex cuts them (" self", ".append", "(self", "):\\n", single digits...) and the words with other leading
characters (" word", ".word", "_word"...), drawn by a seeded frequency-weighted draw, each merged from two earlier
tokens as in a trained BPE; then Qwen's specials, 248,044 tokens in all. `--cross-pieces` adds concatenations of
neighbouring pieces, tokens a BPE behind this pre-tokenizer never has; `--tokenizer DIR` takes a real tokenizer
instead. Both engines get it through their Hugging Face entry points (xgrammar `TokenizerInfo.from_huggingface`,
llguidance `llguidance.hf.from_tokenizer`) with the model's 248,320-row mask. For each grammar (bench/grammar_cases.py:
any JSON, a {"type": "object"} schema, a 9-property schema with and without a maxLength, a date-time regex, a Qwen3
`<tool_call>`) and engine it times: compile (cold; again: xgrammar caches compiled grammars, llguidance compiles each
matcher), a new matcher's first mask, the mask at every position of a valid output tokenized by the BPE
(p50/p90/p99/max/mean; each walked token must be in the mask), accept, rollback of k = 3 drafts and their re-accept,
and the masks of 16 sequences at staggered positions for one step, one after another and through the engine's batch
API. Prints a Markdown table; --out also keeps per-position medians and allowed-token counts.
Run: python -P bench/grammar_mask_bench.py [--quick] [--out r.json]  (-P: bench/kernels.py shadows `kernels`)."""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
from pathlib import Path
import os
import sys
import time
from types import SimpleNamespace

import numpy as np


def load_sibling(name: str) -> None:
    """Load bench/<name>.py by its path unless imported already: -P keeps bench/ off sys.path (bench/kernels.py
    would shadow the `kernels` package there), so a plain import of a sibling module could not find it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])


load_sibling("grammar_cases")
load_sibling("synthetic_tokenizer")
from grammar_cases import Grammar, grammars  # noqa: E402
from synthetic_tokenizer import ADDED, EOS, SPECIAL, build_hf_tokenizer, build_vocab  # noqa: E402


def xgrammar_engine(hf, vocab_size: int, threads: int) -> SimpleNamespace:
    """TokenizerInfo -> GrammarCompiler (caches by grammar) -> CompiledGrammar -> a GrammarMatcher per request."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[hf.eos_token_id])
    compiler, batcher = xgr.GrammarCompiler(info, max_threads=threads), xgr.BatchGrammarMatcher(max_threads=threads)
    return SimpleNamespace(name="xgrammar", compile=lambda g: g.xgr(compiler), matcher=xgr.GrammarMatcher,
                           bitmask=lambda n: xgr.allocate_token_bitmask(n, vocab_size),  # torch.int32, CPU
                           fill=lambda m, bm, i=0: m.fill_next_token_bitmask(bm, i),
                           fill_batch=batcher.batch_fill_next_token_bitmask, accept=lambda m, t: m.accept_token(t),
                           done=lambda m: m.is_terminated())


def llguidance_engine(hf, vocab_size: int, threads: int) -> SimpleNamespace:
    """LLTokenizer -> an LLMatcher per grammar (it compiles there; no compiled-grammar object) -> deep_copy per
    request."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp
    tok, executor = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size), llguidance.LLExecutor(num_threads=threads)

    def compile_(g: Grammar):
        m = llguidance.LLMatcher(tok, g.llg())
        need(not m.is_error(), m.get_error())
        return m
    return SimpleNamespace(name="llguidance", compile=compile_, matcher=lambda m: m.deep_copy(),
                           bitmask=lambda n: lnp.allocate_token_bitmask(n, vocab_size),  # numpy int32
                           fill=lambda m, bm, i=0: lnp.fill_next_token_bitmask(m, bm, i),
                           fill_batch=lambda ms, bm: lnp.fill_next_token_bitmask_par(
                               executor, [(m, i) for i, m in enumerate(ms)], bm),
                           accept=lambda m, t: m.consume_token(t), done=lambda m: m.is_stopped() and not m.is_error())


def allowed(row: np.ndarray, tok: int) -> bool:
    """Bit tok of a mask row: int32 words, token t at word t // 32, bit t % 32 (LSB first); 1 = allowed."""
    return bool((int(row[tok >> 5]) >> (tok & 31)) & 1)


def need(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


STATS = ("p50", "p90", "p99", "max", "mean")


def stats_us(ns: list[int]) -> dict:
    a = np.asarray(ns, float) / 1e3
    return {"p50": np.percentile(a, 50), "p90": np.percentile(a, 90), "p99": np.percentile(a, 99), "max": a.max(),
            "mean": a.mean(), "n": len(a)}


def bench(eng, g: Grammar, ids: list[int], reps: int, batch: int, batch_steps: int) -> dict:
    clock, where = time.perf_counter_ns, f"{eng.name}, {g.name}"
    t0 = clock(); compiled = eng.compile(g); t1 = clock(); eng.compile(g); t2 = clock()
    r = {"compile_ms": (t1 - t0) / 1e6, "compile_again_ms": (t2 - t1) / 1e6}
    view = np.asarray(bm := eng.bitmask(1))                # int32 (rows, ceil(V / 32)); view: numpy, same memory
    t0 = clock(); m = eng.matcher(compiled); t1 = clock(); eng.fill(m, bm); t2 = clock()
    r["new_matcher_us"], r["first_mask_us"] = (t1 - t0) / 1e3, (t2 - t1) / 1e3
    mask, accept, n_allowed = [], [], []
    for rep in range(reps):                                # walk the output: mask, check the token, accept it
        m = eng.matcher(compiled)
        for tok in ids:
            t0 = clock(); eng.fill(m, bm); t1 = clock()
            need(allowed(view[0], tok), f"{where}: token {tok} masked off")
            t2 = clock(); ok = eng.accept(m, tok); t3 = clock()
            need(ok, f"{where}: token {tok} not accepted")
            mask.append(t1 - t0); accept.append(t3 - t2)
            if rep == 0:
                n_allowed.append(int(np.unpackbits(view[0].view(np.uint8)).sum()))
        need(eng.done(m), f"{where}: not terminated after EOS")
    r.update(mask_us=stats_us(mask), accept_us=stats_us(accept), mean_allowed_tokens=float(np.mean(n_allowed)),
             mask_us_median_by_position=(np.median(np.reshape(mask, (reps, -1)), 0) / 1e3).round(1).tolist())
    rollback, reaccept = [], []                            # speculative decoding, k = 3: drop 3 drafts, redo them
    for _ in range(reps):
        m = eng.matcher(compiled)
        for pos, tok in enumerate(ids[:-1]):
            eng.accept(m, tok)
            if pos >= 2:
                t0 = clock(); m.rollback(3); t1 = clock()
                ok = all([eng.accept(m, t) for t in ids[pos - 2:pos + 1]]); t2 = clock()
                need(ok, f"{where}: re-accept after rollback failed")
                rollback.append(t1 - t0); reaccept.append(t2 - t1)
    r.update(rollback3_us=stats_us(rollback), reaccept3_us=stats_us(reaccept))
    view = np.asarray(bm := eng.bitmask(batch))            # `batch` sequences at staggered positions, each step
    ms, pos = [eng.matcher(compiled) for _ in range(batch)], [j * len(ids) // batch for j in range(batch)]
    need(all(eng.accept(m, t) for m, p in zip(ms, pos) for t in ids[:p]), f"{where}: staggering failed")
    one_by_one, batch_api = [], []
    for step in range(batch_steps):
        for way in ((0, 1) if step % 2 else (1, 0)):       # alternate which goes first
            t0 = clock()
            if way == 0:
                for i, m in enumerate(ms):
                    eng.fill(m, bm, i)
            else:
                eng.fill_batch(ms, bm)
            (one_by_one if way == 0 else batch_api).append(clock() - t0)
        for j, m in enumerate(ms):
            need(allowed(view[j], ids[pos[j]]) and eng.accept(m, ids[pos[j]]), f"{where}: batch row {j} refused")
            pos[j] += 1
            if pos[j] == len(ids):
                m.reset(); pos[j] = 0
    r.update(batch_one_by_one_us=stats_us(one_by_one), batch_api_us=stats_us(batch_api))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=248320, help="mask width: the model's embedding rows")
    ap.add_argument("--tokens", type=int, default=248044, help="tokenizer entries (the rest of the mask: padding)")
    ap.add_argument("--corpus-mb", type=float, default=64, help="stdlib source text to read, MiB")
    ap.add_argument("--cross-pieces", action="store_true", help="add concatenations of neighbouring pieces")
    ap.add_argument("--tokenizer", help="a local Hugging Face tokenizer directory to use instead of the synthetic one")
    ap.add_argument("--reps", type=int, default=50, help="walks of each output per engine and grammar")
    ap.add_argument("--batch", type=int, default=16, help="sequences masked per step in the batch test")
    ap.add_argument("--batch-steps", type=int, default=200, help="steps of the batch test")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of compilers and batch APIs")
    ap.add_argument("--seed", type=int, default=0, help="seed of the vocabulary draw")
    ap.add_argument("--quick", action="store_true", help="32,000-token vocabulary, 8 MiB corpus, 3 reps, 20 steps")
    ap.add_argument("--out", help="also write the results here, as JSON")
    ap.add_argument("--save-tokenizer", metavar="DIR", help="write the synthetic tokenizer into DIR (e.g. a make-tiny "
                                                            "checkpoint, for `specdec bench --grammar`; EOS at its "
                                                            "config's eos_token_id) and stop")
    args = ap.parse_args()
    if args.quick:
        args.vocab_size, args.tokens, args.corpus_mb, args.reps, args.batch_steps = 32000, 31900, 8, 3, 20
    import xgrammar
    t0 = time.perf_counter()
    if args.tokenizer:                                     # a real one, once there is one (its EOS: eos_token_id)
        hf = __import__("transformers").AutoTokenizer.from_pretrained(args.tokenizer)
        tokens = [hf.decode([i]).encode() for i in range(len(hf))]   # for the counts only (partial UTF-8: U+FFFD)
    else:
        tokens, merges = build_vocab(args.tokens - len(SPECIAL) - len(ADDED), args.corpus_mb, args.seed,
                                     args.cross_pieces)
        eos_id = None
        config = Path(args.save_tokenizer or "") / "config.json"
        if args.save_tokenizer and config.is_file():   # the model's EOS must be the tokenizer's (grammars end on it)
            c = json.loads(config.read_text())
            eos = c.get("text_config", c).get("eos_token_id", c.get("eos_token_id"))
            eos_id = eos[0] if isinstance(eos, list) else eos
        hf, tokens = build_hf_tokenizer(tokens, merges, eos_id), tokens + [s.encode() for s in SPECIAL + ADDED]
        if args.save_tokenizer:
            hf.save_pretrained(args.save_tokenizer)
            print(f"{len(hf)} tokens written to {args.save_tokenizer} in {time.perf_counter() - t0:.1f} s, EOS "
                  f"{EOS} = {hf.eos_token_id}")
            return
    n_ascii = sum(t.isascii() for t in tokens)
    vocab = {"tokens": len(hf), "mask_width": args.vocab_size, "ascii": n_ascii, "non_ascii": len(hf) - n_ascii,
             "mean_bytes": float(np.mean([len(t) for t in tokens])), "build_s": time.perf_counter() - t0}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    res = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}, "args": vars(args),
           "versions": {n: importlib.metadata.version(n) for n in ("xgrammar", "llguidance", "tokenizers")},
           "vocab": vocab, "engines": {}, "outputs": {}}
    print(f"{cpu}, {os.cpu_count()} cores; {res['versions']}\nvocabulary: {len(hf)} tokens ({n_ascii} ASCII, "
          f"{len(hf) - n_ascii} non-ASCII, mean {vocab['mean_bytes']:.1f} bytes), mask width {args.vocab_size}, "
          f"EOS {hf.eos_token!r} = {hf.eos_token_id}; built in {vocab['build_s']:.1f} s")
    gs = grammars(xgrammar)
    ids = {g.name: hf.encode(g.text, add_special_tokens=False) + [hf.eos_token_id] for g in gs}
    res["outputs"] = {name: [hf.decode([t]) for t in toks] for name, toks in ids.items()}
    warm = [Grammar("warm-up", lambda c: c.compile_regex("[a-z]+"), lambda: "start: /[a-z]+/", ""),
            Grammar("warm-up", lambda c: c.compile_json_schema({"type": "string"}),
                    lambda: json.dumps({"grammars": [{"json_schema": {"type": "string"}}]}), "")]
    for make in (xgrammar_engine, llguidance_engine):
        t0 = time.perf_counter()
        eng = make(hf, args.vocab_size, args.threads)
        t1 = time.perf_counter()
        for g in warm:                                     # one-time set-up: no grammar's cost
            eng.fill(eng.matcher(eng.compile(g)), eng.bitmask(1))
        e = res["engines"][eng.name] = {"tokenizer_s": t1 - t0, "warm_up_ms": (time.perf_counter() - t1) * 1e3}
        print(f"{eng.name}: tokenizer info from the HF tokenizer {e['tokenizer_s']:.2f} s, then warm-up (a regex "
              f"and a string schema, compiled and masked once) {e['warm_up_ms']:.1f} ms")
        gc.collect(); gc.disable()
        e["grammars"] = {g.name: bench(eng, g, ids[g.name], args.reps, args.batch, args.batch_steps) for g in gs}
        gc.enable()
    res["machine"]["loadavg_end"] = os.getloadavg()
    print(f"\nµs unless marked; mask/accept: {args.reps} walks of each output; {args.batch} seq: all masks of one "
          f"step, {args.batch_steps} steps; batch API on {args.threads} threads; load average (1, 5, 15 min) "
          f"{res['machine']['loadavg_start']} at the start, {res['machine']['loadavg_end']} at the end\n")
    head = ["grammar (tokens)", "engine", "compile ms: cold / again", "1st mask", "mask p50", "p90", "p99", "max",
            "mean", "accept", "rollback 3", "re-accept 3", f"{args.batch} seq one by one", f"{args.batch} seq batch"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for g in gs:
        for name, e in res["engines"].items():
            r = e["grammars"][g.name]
            cells = [f"{g.name} ({len(ids[g.name])})", name, f"{r['compile_ms']:.1f} / {r['compile_again_ms']:.2f}",
                     *(f"{x:.0f}" for x in [r["first_mask_us"], *(r["mask_us"][k] for k in STATS)]),
                     *(f"{r[k]['mean']:.1f}" for k in ("accept_us", "rollback3_us", "reaccept3_us")),
                     *(f"{r[k]['mean']:.0f}" for k in ("batch_one_by_one_us", "batch_api_us"))]
            print("| " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=float)


if __name__ == "__main__":
    main()
