"""`specdec drafter`: serve a drafter (mtp | ngram | synthetic) over gRPC."""
import argparse

from .cli_args import add_listen_args, add_model_args, resolve


def add_parser(sub) -> None:
    p = sub.add_parser("drafter", help="serve a drafter (mtp, ngram, synthetic) over gRPC",
                       description="Serve one drafter. The verifier connects to it; stopping this process and "
                                   "starting another kind on the same address swaps the drafter without "
                                   "restarting the verifier.")
    p.add_argument("--kind", default="mtp", choices=["mtp", "ngram", "synthetic"])
    p.add_argument("-k", "--num-drafts", type=int, default=3, help="most draft tokens per step")
    add_model_args(p)
    add_listen_args(p, 50053)
    p.add_argument("--kv-blocks", type=int, default=4096, help="MTP KV cache blocks (of 16 tokens)")
    p.add_argument("--references", default=None, help="synthetic: JSON list of token-id lists")
    p.add_argument("--mean-acceptance-length", type=float, default=None, help="synthetic: target length")
    p.add_argument("--vocab-size", type=int, default=0, help="synthetic: vocabulary (default: from --model)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from drafter_service.factory import DrafterConfig
    from drafter_service.server import serve
    model, device, dtype = resolve(args) if args.kind == "mtp" or args.model else (None, "cpu", "float32")
    if args.kind != "mtp" and args.device != "auto":
        device = args.device
    config = DrafterConfig(kind=args.kind, max_drafts=args.num_drafts, model_dir=model, device=device, dtype=dtype,
                           num_blocks=args.kv_blocks, references=args.references,
                           mean_acceptance_length=args.mean_acceptance_length, vocab_size=args.vocab_size)
    serve(config, args.host, args.port)
    return 0
