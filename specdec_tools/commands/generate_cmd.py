"""`specdec generate`: stream a completion from a running gateway, or from a stack started for the call."""
import argparse
import sys
import tempfile

from .serve_cmd import add_stack_args, stack_config
from .cli_args import add_client_security_args, add_model_args, client_security


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion to the terminal",
                       description="Stream a completion from the gateway at --address; without --address, start "
                                   "the local stack (as `specdec serve` would), generate, and stop it.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text")
    p.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of text")
    p.add_argument("--address", default=None, help="HOST:PORT of a running gateway")
    add_model_args(p)
    add_stack_args(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]; 1: off")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1: off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0: off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0: off")
    p.add_argument("--seed", type=int, default=None, help="reproducible sampling (same tokens with or without drafts)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-speculation", action="store_true",
                   help="this request verifies no drafts (gRPC SamplingParams.speculation = false): the same text, "
                        "decoded plainly; the stack's drafter stays up for other requests")
    add_client_security_args(p)
    p.set_defaults(run=run, in_process_default=True)


def run(args: argparse.Namespace) -> int:
    from specdec_tools.client import stream_completion
    if args.prompt is None and not args.prompt_token_ids:
        raise ValueError("give a prompt or --prompt-token-ids")
    try:
        ids = [int(t) for t in args.prompt_token_ids.split(",")] if args.prompt_token_ids else None
    except ValueError as e:
        raise ValueError(f"--prompt-token-ids: expected comma-separated integers ({e})") from e
    security = client_security(args)
    if args.address:
        return stream_completion(args.address, args, ids, security)
    from specdec_tools.local_stack import LocalStack, run_stack
    with tempfile.TemporaryDirectory(prefix="specdec-logs-") as logs:
        stack = LocalStack(stack_config(args, port=0, log_dir=logs))
        c = stack.config
        where = " in the verifier's process" if c.drafter_in_process and c.drafter != "none" else ""
        print(f"starting the local stack ({c.drafter} drafter{where}, k={c.num_drafts}, {c.device}) ...",
              file=sys.stderr, flush=True)
        return run_stack(stack, lambda address: stream_completion(address, args, ids))
