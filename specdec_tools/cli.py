"""`specdec` console script: one subcommand per job; each builds its config here and passes it down."""
from __future__ import annotations

import argparse
import logging
import sys

from .commands import (bench_cmd, draft_vocab_cmd, drafter_cmd, gateway_cmd, generate_cmd, health_cmd, make_tiny_cmd,
                       serve_cmd, trace_report_cmd, train_demo_cmd, verifier_cmd)

COMMANDS = [serve_cmd, generate_cmd, verifier_cmd, drafter_cmd, gateway_cmd, health_cmd, make_tiny_cmd,
            train_demo_cmd, bench_cmd, draft_vocab_cmd, trace_report_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=(
        "Speculative-decoding serving for Qwen3.5 / Qwen3-Next hybrid models."))
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit (SIGTERM) when the process PARENT_PID exits; `specdec serve` sets it for the "
                             "services it starts, so none outlives it")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid is not None:
        from specdec.process_guard import die_with_parent
        die_with_parent(args.parent_pid)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError: a user error, not a trace
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
