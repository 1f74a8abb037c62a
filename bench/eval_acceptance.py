"""Acceptance on held-out text through our engine: mean acceptance length (tokens per verify step, bonus
included) and per-position acceptance, per drafter, k and temperature.

    PYTHONPATH=. python -P bench/eval_acceptance.py --model specdec/demo_model --num-prompts 50 --out bench/results/cpu/demo_acceptance.json

(-P: bench/kernels.py must not shadow the kernels package.)

With --draft-vocabs FILE..., each `specdec draft-vocab` file adds an MTP run drafting over those ids only
(labelled mtp/<size>), and the table shows the drafter's time per call beside the acceptance.

With --grammar KIND[:TEXT|@FILE] every request is constrained (e.g. json_schema@schema.json), and each MTP run is
made twice: drafts masked by the grammar (mtp+masks, the default drafter) and unmasked (mtp).

Prompts are windows of the held-out standard-library files (specdec_tools/train/corpus.py HELD_OUT), never trained on.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gateway.tokenizer import TextTokenizer
from specdec.models.loader import load_model
from specdec.sampling_params import GrammarSpec, SamplingParams
from specdec_tools.commands.bench_cmd import parse_grammar
from specdec_tools.commands.in_process_drafter import in_process_drafter
from specdec_tools.train.corpus import held_out_files, read_text
from verifier_service.builder import VerifierConfig, build_engine


def held_out_prompts(tokenizer: TextTokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, spread evenly over the held-out files (several windows per file)."""
    streams = [tokenizer.encode(read_text(f)) for f in held_out_files()]
    streams = [s for s in streams if len(s) > 2 * length]
    per_file = -(-n // len(streams))
    prompts = []
    for s in streams:
        for i in range(per_file):
            start = (len(s) - length) * (i + 1) // (per_file + 1)
            prompts.append(s[start:start + length])
    return prompts[:n]


def run_one(loaded, drafter_kind: str, k: int, temperature: float, prompts, max_tokens: int, device: str,
            draft_vocab: str | None = None, grammar: GrammarSpec | None = None, draft_masks: str = "on",
            model_dir: str = "") -> dict:
    config = VerifierConfig(model_dir=model_dir, device=device, num_drafts=k, in_process_drafter=drafter_kind,
                            max_running=16, max_batched_tokens=2048, prefill_chunk=512, kv_blocks=len(prompts) * 20,
                            warm_up=False)
    engine = build_engine(config, in_process_drafter(drafter_kind, draft_vocab, draft_masks), loaded)
    vocab = engine.drafter.loop.vocab_ids if drafter_kind == "mtp" else None
    calls, propose = [0, 0.0], engine.drafter.propose

    def timed(batch):
        start = time.perf_counter()
        out = propose(batch)
        calls[0], calls[1] = calls[0] + 1, calls[1] + time.perf_counter() - start
        return out
    engine.drafter.propose = timed
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, ignore_eos=True, grammar=grammar)
              for i in range(len(prompts))]
    start = time.perf_counter()
    engine.generate(prompts, params)
    s = engine.stats
    label = drafter_kind if vocab is None else f"{drafter_kind}/{len(vocab)}"
    label += "+masks" if grammar is not None and getattr(engine.drafter, "draft_masks", None) is not None else ""
    return {"drafter": label, "grammar": grammar.kind if grammar is not None else None, "draft_vocab": draft_vocab,
            # (None: every draft was made on the device inside overlapped steps, propose() never ran)
            "drafter_ms_per_call": round(1e3 * calls[1] / calls[0], 3) if calls[0] else None,
            "k": k, "temperature": temperature, "prompts": len(prompts),
            "mean_acceptance_length": round(s.mean_acceptance_length, 3),
            "per_position_acceptance": [round(r, 3) for r in s.per_position_acceptance],
            "drafted": s.drafted, "accepted": s.accepted, "verify_steps": s.verify_steps,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafters", nargs="+", default=["mtp", "ngram"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--draft-vocabs", nargs="*", default=[], metavar="FILE",
                   help="`specdec draft-vocab` files: an extra MTP run over each one's ids")
    p.add_argument("--grammar", default=None, metavar="KIND[:TEXT|@FILE]",
                   help="constrain every request (json_object, json_schema@FILE, regex:TEXT ...); MTP runs twice, "
                        "with and without grammar masks on its drafts")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    grammar = GrammarSpec(*parse_grammar(args.grammar)) if args.grammar else None
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    prompts = held_out_prompts(TextTokenizer.from_folder(args.model), args.num_prompts, args.prompt_len)
    results = []
    print(f"{'drafter':10} {'k':>2} {'temp':>5} {'mean acc len':>12} {'drafter ms':>10}  per-position acceptance")
    runs = [(d, None, "on") for d in args.drafters] + [("mtp", f, "on") for f in args.draft_vocabs]
    if grammar is not None:   # + each MTP run unmasked
        runs += [(d, vocab, "off") for d, vocab, _ in runs if d == "mtp"]
    for drafter, vocab, masks in runs:
        for temperature in args.temperatures:
            for k in args.ks:
                r = run_one(loaded, drafter, k, temperature, prompts, args.max_tokens, args.device, vocab, grammar,
                            masks, args.model)
                results.append(r)
                print(f"{r['drafter']:10} {k:>2} {temperature:>5.1f} {r['mean_acceptance_length']:>12.2f} "
                      f"{r['drafter_ms_per_call'] or float('nan'):>10.2f}  {r['per_position_acceptance']}  ({r['seconds']} s)",
                      flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "prompts": len(prompts), "grammar": args.grammar,
                                              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
