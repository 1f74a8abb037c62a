"""`specdec gateway`: the public gRPC endpoint (tokenizer, detokenizer, stop strings). Imports no torch."""
import argparse
import os


def add_parser(sub) -> None:
    p = sub.add_parser("gateway", help="serve the public API (specdec.rpc.v1.Gateway)",
                       description="Tokenize, forward to the verifier, stream tokens and text back.")
    p.add_argument("--model", default=os.environ.get("SPECDEC_MODEL") or None,
                   help="model folder, for its tokenizer files (default: $SPECDEC_MODEL, else the demo model)")
    p.add_argument("--verifier-address", default="127.0.0.1:50052")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from specdec.demo import DEMO_DIR
    model = args.model or (str(DEMO_DIR) if (DEMO_DIR / "config.json").is_file() else None)
    serve(model, args.verifier_address, args.host, args.port)
    return 0
