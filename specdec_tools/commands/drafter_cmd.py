"""`specdec drafter`: serve a drafter (mtp | draft_model | ngram | synthetic | an installed plugin) over gRPC."""
import argparse

from .cli_args import (add_enforce_eager_arg, add_listen_args, add_load_format_arg, add_model_args, add_trace_steps_arg,
                       resolve)

KINDS_HELP = ("mtp (the target's MTP head; needs --model), draft_model (a smaller model; needs --draft-model), "
              "ngram (prompt lookup), synthetic (benchmarks), or the name of an installed plugin "
              "(entry point group specdec.drafters; see docs/drafters.md)")


def add_parser(sub) -> None:
    p = sub.add_parser("drafter", help="serve a drafter (mtp, draft_model, ngram, synthetic, plugins) over gRPC",
                       description="Serve one drafter. The verifier connects to it; stopping this process and "
                                   "starting another kind on the same address swaps the drafter without "
                                   "restarting the verifier, and running requests draft again within a step or two.")
    p.add_argument("--kind", default="mtp", help=KINDS_HELP)
    p.add_argument("-k", "--num-drafts", type=int, default=3, help="most draft tokens per step")
    add_model_args(p)
    add_load_format_arg(p)
    add_listen_args(p, 50053)
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="mtp / draft_model KV cache blocks of 16 tokens (default 0: on a GPU, what "
                        "--gpu-memory-utilization leaves after the weights; 4096 on the CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.05, metavar="FRACTION",
                   help="mtp / draft_model on a GPU: the share of its memory this process may hold, KV cache included "
                        "(default 0.05: beside a verifier at its default 0.9)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="draft_model: a smaller checkpoint of a supported family with the target's tokenizer")
    p.add_argument("--max-seqs", type=int, default=64,
                   help="draft_model: sequences it keeps state for at once; mtp: the largest batch drafted in a "
                        "CUDA graph (larger batches draft eagerly)")
    p.add_argument("--max-context", type=int, default=0,
                   help="mtp: longest sequence it drafts for (longer ones decode without drafts; default 0: the "
                        "model's max_position_embeddings, as the verifier's)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="mtp: draft over the ids of this `specdec draft-vocab` file only (a faster lm_head; "
                        "still lossless, acceptance may drop)")
    add_enforce_eager_arg(p)
    p.add_argument("--draft-masks", default="auto", choices=["auto", "on", "off"],
                   help="mtp: keep a grammar-constrained sequence's drafts inside its grammar (one host sync per "
                        "draft step, eager). auto (default): on the CPU and with --enforce-eager, off where CUDA "
                        "graphs replay the draft steps. The output is the same either way")
    p.add_argument("--references", default=None, help="synthetic: JSON list of token-id lists")
    p.add_argument("--mean-acceptance-length", type=float, default=None, help="synthetic: target length")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="the target's vocabulary, for synthetic and --count-tokens (default: from --model)")
    p.add_argument("--count-tokens", default=None, metavar="FILE",
                   help="count the tokens the target generates into FILE (JSON; added to if it exists), for "
                        "`specdec draft-vocab --counts FILE`; saved every --count-every seconds and on shutdown")
    p.add_argument("--count-every", type=float, default=60.0, metavar="SECONDS",
                   help="how often --count-tokens saves its file (default: 60)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="plugins: an option passed to the plugin's factory (repeatable)")
    add_trace_steps_arg(p)
    p.add_argument("--list-kinds", action="store_true", help="print the kinds this install can serve and exit")
    p.set_defaults(run=run)


def parse_options(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def counted_vocab_size(args: argparse.Namespace, model: str | None) -> int:
    """The target's vocabulary size for --count-tokens: --vocab-size, else from the model folder."""
    if not args.count_tokens:
        return args.vocab_size
    if args.count_every <= 0:
        raise ValueError(f"--count-every must be > 0 seconds, got {args.count_every}")
    if args.vocab_size:
        return args.vocab_size
    if not model:
        raise ValueError("--count-tokens needs the target's vocabulary size: pass --model (the target's folder) "
                         "or --vocab-size")
    from specdec.models.model_config import ModelConfig
    return ModelConfig.from_folder(model).vocab_size


def run(args: argparse.Namespace) -> int:
    from drafter_service.factory import DrafterConfig, available_kinds
    from drafter_service.server import serve
    kinds = available_kinds()
    if args.list_kinds:
        print("\n".join(kinds))
        return 0
    if args.kind not in kinds:
        raise ValueError(f"--kind {args.kind!r} is not a drafter this install knows; choose one of {', '.join(kinds)}")
    model, device, dtype = resolve(args)  # mtp: --model defaults to the demo model; the others take it as given
    model = model if args.kind == "mtp" else args.model
    if args.kind in ("ngram", "synthetic") and args.device == "auto":
        device, dtype = "cpu", "float32"  # model-free: no reason to touch a GPU
    if args.kv_blocks < 0 or args.max_context < 0 or not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError("--kv-blocks and --max-context must be >= 0 (0: the default), --gpu-memory-utilization in "
                         "(0, 1]")
    config = DrafterConfig(kind=args.kind, max_drafts=args.num_drafts, model_dir=model, device=device, dtype=dtype,
                           num_blocks=args.kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                           references=args.references,
                           mean_acceptance_length=args.mean_acceptance_length,
                           vocab_size=counted_vocab_size(args, model),
                           draft_model_dir=args.draft_model, max_seqs=args.max_seqs, max_context=args.max_context,
                           enforce_eager=args.enforce_eager, draft_vocab=args.draft_vocab,
                           options=parse_options(args.option), count_tokens=args.count_tokens,
                           count_every_s=args.count_every, trace_steps=args.trace_steps,
                           load_format=args.load_format, draft_masks=args.draft_masks)
    serve(config, args.host, args.port)
    return 0
