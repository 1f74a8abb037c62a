"""`specdec trace-report FILE...`: where the step time goes, from `--trace-steps` files."""
import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("trace-report", help="median time of each step phase from --trace-steps files",
                       description="Line up the --trace-steps files of a verifier and its drafter (same host: one "
                                   "clock) and print, per batch size, the median and p90 of each segment of a "
                                   "step's critical path: target launch, GPU wait and sampling, the message to "
                                   "the drafter, its work, the answer back, and the engine's wait for it.")
    p.add_argument("files", nargs="+", metavar="FILE", help="trace files (JSON lines)")
    p.add_argument("--min-steps", type=int, default=20, help="report batch sizes seen in at least this many steps")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdec.step_trace import read_marks
    from specdec_tools.trace_report import report
    print(report(read_marks(args.files), args.min_steps))
    return 0
