"""`specdec bench`: tokens/s, latency, step split and bandwidth use of the stack, in-process engine and peer."""
import argparse
import json
import shlex
import sys
from pathlib import Path

from .cli_args import (add_load_format_arg, add_model_args, add_no_overlap_arg, add_quantization_arg,
                       add_tensor_parallel_arg, resolve)

PRESET_TIMEOUTS = {"full": 600.0, "baseline": 40.0, "quick": 60.0, "adaptive": 60.0, "long": 300.0,
                   "multiturn": 180.0}


def add_parser(sub) -> None:
    from specdec_tools.tiny_presets import PRESETS as TINY
    p = sub.add_parser(
        "bench", help="benchmark throughput and latency (gateway, in-process engine, transformers peer)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a matrix of workloads (concurrency x prompt length x temperature x drafter) through the "
                    "real stack (gateway -> verifier -> drafter, N concurrent gRPC streams; colocated: the drafter "
                    "inside the verifier), the engine in-process "
                    "and transformers `generate` on the same checkpoint; measure the device copy bandwidth and the "
                    "bare weight-GEMM chain in the same run; write JSON, a text table and a PNG.",
        epilog="examples:\n"
               "  specdec bench --quick --device cpu                      # CPU smoke run on the demo model\n"
               "  specdec bench --preset baseline --model /tmp/q35 --make-tiny qwen3.5-4b --layers 32 \\\n"
               "      --time-budget 480 --profile --out $OUT           # the GPU baseline (bench/device/table.sh)\n"
               "  specdec bench --model DIR --paths inproc --drafters none mtp@3.39 --concurrency 1 16\n"
               "  specdec bench --preset adaptive --model /tmp/q35 --make-tiny qwen3.5-4b --layers 32 --out $OUT\n"
               "  specdec bench --preset multiturn --model /tmp/q35 --make-tiny qwen3.5-4b --layers 32 \\\n"
               "      --service-defaults --no-prefix-caching --out $OUT  # issue 39: the prefix cache, on and off\n"
               "  specdec bench --model /tmp/n80 --make-tiny qwen3-next-80b-a3b --load-format dummy \\\n"
               "      --tensor-parallel-size 2 --paths gateway --drafters none mtp@3.39 --concurrency 1 16\n"
               "  specdec bench --render bench/results/h100/bench_baseline_h100.json --markdown")
    add_model_args(p)
    p.add_argument("--preset", default="full", choices=["full", "baseline", "quick", "adaptive", "long", "multiturn"],
                   help="full: the whole matrix (default); baseline: the subset that fits one 9-minute GPU call on "
                        "today's eager path (what it cuts is in the JSON); quick: CPU smoke run; adaptive: the "
                        "fixed and adaptive draft policies against plain decoding (inproc; synthetic drafter at "
                        "acceptance 0.3 / 0.9, mtp@1.5 / mtp@3.39; c1 / c16 / c64); long: prompts of 2k to 128k "
                        "(TTFT, prefill tokens/s, MFU) and 15 decoders joined by a 16k prompt (their ITL before "
                        "and while it prefills), through the gateway; multiturn: 16 conversations at once of 8 turns "
                        "each (a shared 4096-token system prompt, 200 new tokens in and 128 out a turn), through the "
                        "gateway, without a drafter and with mtp@3.39: TTFT of turn 1 against turns >= 2, the prefix "
                        "cache's hit rate")
    p.add_argument("--quick", action="store_const", const="quick", dest="preset", help="same as --preset quick")
    p.add_argument("--make-tiny", default=None, choices=sorted(TINY), metavar="PRESET",
                   help="write a random checkpoint of this make-tiny preset into --model first if it holds none "
                        f"({', '.join(sorted(TINY))})")
    p.add_argument("--layers", type=int, default=None, help="with --make-tiny: decoder layers (shrinks the checkpoint)")
    add_tensor_parallel_arg(p, all_reduce=False)
    add_load_format_arg(p)
    add_quantization_arg(p)
    p.add_argument("--paths", nargs="+", choices=["inproc", "gateway", "colocated", "peer"],
                   help="keep only these paths (colocated: through the gateway with the drafter inside the "
                        "verifier's process; against gateway, what the service split costs)")
    p.add_argument("--drafters", nargs="+", metavar="D", help="keep only these: none ngram mtp@1.5 mtp@2.5 mtp@3.39")
    p.add_argument("--concurrency", nargs="+", type=int, help="keep only these concurrencies")
    p.add_argument("--prompt-tokens", nargs="+", type=int, help="keep only these prompt lengths")
    p.add_argument("--temperatures", nargs="+", type=float, help="keep only these temperatures")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="also run every mtp workload with this `specdec draft-vocab` file (label +dv)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (replaces the preset's)")
    p.add_argument("--turns", type=int, default=None, metavar="N",
                   help="conversation workloads (--preset multiturn): turns per conversation (replaces the preset's 8)")
    p.add_argument("--turn-tokens", type=int, default=None, metavar="N",
                   help="conversation workloads: new user tokens per turn (replaces the preset's 200)")
    p.add_argument("--system-tokens", type=int, default=None, metavar="N",
                   help="conversation workloads: tokens of the system prompt every conversation starts with "
                        "(replaces the preset's 4096; --prompt-tokens filters on the preset's)")
    p.add_argument("--own-system-prompts", action="store_true",
                   help="conversation workloads: each conversation a system prompt of its own (its turn 1 a cold "
                        "prefill) instead of one shared by all")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="gateway and colocated paths: also run every workload on a verifier started with "
                        "--no-prefix-caching (label +nocache), after the workloads of its stack: the prefix cache "
                        "on against off in one run")
    p.add_argument("--workload-timeout", type=float, default=None,
                   help="seconds one workload may run before it is cut (default: full 600, baseline 40, quick 60)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run: a workload that might not finish within it is skipped")
    p.add_argument("--grammar", default=None, metavar="KIND[:TEXT|@FILE]",
                   help="gateway path: every request constrained by this grammar (json_object, json_schema@FILE, "
                        "regex:TEXT, ebnf@FILE ...); time it against a run without. Real drafts only (no mtp@L: "
                        "forced acceptance would accept what the grammar refuses)")
    p.add_argument("--draft-masks", default="auto", choices=["auto", "on", "off"],
                   help="gateway path: the mtp drafter service's --draft-masks (with --grammar: compare on and off "
                        "for what masking the drafts costs and adds to the acceptance length)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="gateway path: the verifier's --prefill-chunk and --mixed-prefill-chunk (default: its own), "
                        "its --max-batched-tokens widened to the chunk plus a verify step of every running sequence")
    p.add_argument("--lone-prefill-chunk", type=int, default=None, metavar="N",
                   help="gateway path: the verifier's --lone-prefill-chunk (prompt chunks of N+ tokens run alone, in "
                        "turns with the decoding sequences)")
    p.add_argument("--verifier-args", default="", metavar="'FLAGS'",
                   help="gateway path: more flags for the verifier service, appended to the bench's, e.g. "
                        "--verifier-args=--all-reduce=nccl or --verifier-args '--all-reduce nccl' (a value that "
                        "starts with -- needs the = or the quotes; an A/B of one flag: two runs that differ only "
                        "here)")
    p.add_argument("--drafter-args", default="", metavar="'FLAGS'",
                   help="gateway path: more flags for the drafter service, e.g. --drafter-args=--device=cuda:1 (a "
                        "GPU of its own)")
    p.add_argument("--service-defaults", action="store_true",
                   help="gateway path: start the verifier and the drafter with their own defaults for the context, "
                        "the running sequences, the token budget, the prefill chunk and the caches (sized from "
                        "memory on a GPU), instead of sizing them for the workloads: what a user gets")
    p.add_argument("--profile", action="store_true", help="torch.profiler summary of in-process decode steps")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--trace-steps", default=None, metavar="DIR",
                   help="gateway and colocated paths: the verifier and the drafter write --trace-steps files into DIR, one pair "
                        "per stack (see `specdec trace-report`)")
    p.add_argument("--step-channel", default="auto", choices=["auto", "grpc"],
                   help="gateway path: the verifier's --step-channel (auto: the drafter's local lane; grpc: the "
                        "gRPC stream, as across hosts)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="inproc, gateway and colocated paths: N timed passes per workload after the warm-up; the "
                        "pass of median tokens/s is reported (all N in passes_tokens_per_s)")
    add_no_overlap_arg(p)
    p.add_argument("--out", default="bench/results", help="folder for the JSON, table and PNG")
    p.add_argument("--tag", default=None, help="file-name suffix (default: the device, e.g. h100, cpu)")
    p.add_argument("--seed", type=int, default=0, help="prompts and the checkpoint")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--render", default=None, metavar="JSON", help="print the table of an earlier run and redraw its "
                                                                  "PNG beside it; runs nothing")
    p.add_argument("--markdown", action="store_true", help="with --render: a Markdown table")
    p.add_argument("--list", action="store_true", help="print the planned workloads and what the preset cuts; "
                                                       "run nothing")
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace):
    from specdec_tools.bench import presets
    from specdec_tools.bench.bench_run import BenchConfig
    model, device, dtype = resolve(args)
    make, cut = presets.PRESETS[args.preset]
    for name in ("turns", "turn_tokens", "system_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    workloads = make()
    chosen = presets.select(workloads, args.paths, args.drafters, args.concurrency, args.prompt_tokens,
                             args.temperatures, args.max_tokens, args.draft_vocab,
                             no_prefix_cache=args.no_prefix_caching, turns=args.turns, turn_tokens=args.turn_tokens,
                             system_tokens=args.system_tokens, own_system_prompts=args.own_system_prompts)
    if not chosen:
        names = [w.name for w in workloads]
        listed = ", ".join(names[:12]) + (f", and {len(names) - 12} more" if len(names) > 12 else "")
        raise ValueError("the filters (--paths/--drafters/--concurrency/--prompt-tokens/--temperatures) leave no "
                         f"workload of preset {args.preset!r}, whose workloads are (path/drafter/c<concurrency>/"
                         f"p<prompt tokens>/o<output>/T<temperature>): {listed}")
    shape = [f"--{n.replace('_', '-')}" for n in ("turns", "turn_tokens", "system_tokens")
             if getattr(args, n) is not None] + (["--own-system-prompts"] if args.own_system_prompts else [])
    if shape and not any(w.turns for w in chosen):
        raise ValueError(f"{' / '.join(shape)} shape conversation workloads: the chosen ones have none "
                         "(--preset multiturn)")
    if args.no_prefix_caching and not any(w.on_stack for w in chosen):
        raise ValueError("--no-prefix-caching turns off the verifier service's prefix cache: add --paths gateway")
    for name in ("workload_timeout", "time_budget", "layers", "profile_steps", "repeats", "prefill_chunk",
                 "lone_prefill_chunk"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.tensor_parallel_size > 1 or args.load_format == "dummy":
        other = sorted({w.path for w in chosen} - {"gateway"})
        if other:
            raise ValueError(f"--tensor-parallel-size / --load-format dummy time the gateway path only (the "
                             f"verifier starts the ranks); drop --paths {' '.join(other)} or filter with "
                             f"--paths gateway")
    if (args.verifier_args or args.drafter_args) and {w.path for w in chosen} - {"gateway"}:
        raise ValueError("--verifier-args / --drafter-args reach the services of the gateway path only: add "
                         "--paths gateway")
    if args.quantization != "none" and any(w.path == "peer" for w in chosen):
        raise ValueError("--quantization times our stack only (the peer is transformers in its dtype): drop the "
                         "peer path (--paths gateway inproc colocated)")
    grammar = parse_grammar(args.grammar) if args.grammar else None
    if grammar is not None:
        if {w.path for w in chosen} - {"gateway"}:
            raise ValueError("--grammar times the gateway path only: add --paths gateway")
        if any(w.forced_length for w in chosen):
            raise ValueError("--grammar needs real drafts (--drafters none ngram mtp): forced acceptance (mtp@L) "
                             "accepts drafts the grammar refuses")
    filters = [f"--{n} {getattr(args, n)}" for n in ("paths", "drafters", "concurrency", "prompt_tokens",
                                                     "temperatures", "max_tokens", "draft_vocab", "turns",
                                                     "turn_tokens", "system_tokens") if getattr(args, n)]
    filters += ["--no-prefix-caching"] if args.no_prefix_caching else []
    filters += ["--own-system-prompts"] if args.own_system_prompts else []
    return BenchConfig(
        model=model, device=device, dtype=dtype, preset=args.preset, workloads=tuple(chosen),
        cut=tuple(cut) + (("filtered: " + ", ".join(filters),) if filters else ()), out_dir=args.out, tag=args.tag,
        make_tiny=args.make_tiny, layers=args.layers,
        workload_timeout_s=args.workload_timeout or PRESET_TIMEOUTS[args.preset], time_budget_s=args.time_budget,
        profile=args.profile, profile_steps=args.profile_steps, trace_steps_dir=args.trace_steps,
        step_channel=args.step_channel, repeats=args.repeats, overlap=args.overlap,
        plot=not args.no_plot, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format, quantization=args.quantization, grammar=grammar, draft_masks=args.draft_masks,
        prefill_chunk=args.prefill_chunk, service_defaults=args.service_defaults,
        lone_prefill_chunk=args.lone_prefill_chunk, verifier_args=tuple(shlex.split(args.verifier_args)),
        drafter_args=tuple(shlex.split(args.drafter_args)),
        command="specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:]))


def parse_grammar(value: str) -> tuple[str, str]:
    """"json_object", "json_schema@schema.json", "regex:[0-9]+" → (kind, text), checked."""
    from specdec.sampling_params import GrammarSpec
    kind, sep, rest = value.partition("@") if "@" in value.split(":", 1)[0] else value.partition(":")
    text = Path(rest).read_text() if sep == "@" else rest
    GrammarSpec(kind, text).validate()
    return kind, text


def run(args: argparse.Namespace) -> int:
    from specdec_tools.bench import report
    if args.render:
        record = json.loads(Path(args.render).read_text())
        if not args.no_plot:
            report.plot(record, Path(args.render).with_suffix(".png"))
        print(report.render_table(record, markdown=args.markdown))
        return 0
    from specdec_tools.bench.bench_run import BenchRun
    config = build_config(args)
    if args.list:
        print("\n".join([f"{len(config.workloads)} workloads ({config.preset}, {config.device}, {config.dtype}):",
                          *(f"  {w.name}" for w in config.workloads), "cut from the full matrix:",
                          *(f"  {c}" for c in config.cut or ["nothing"])]))
        return 0
    bench = BenchRun(config)
    record = bench.run()
    print(report.render_table(record))
    print(f"\nwrote {', '.join(str(p) for p in bench.paths().values() if p.exists())}", file=sys.stderr)
    return 1 if record["problems"] else 0
