"""`specdec train-demo`: train the embedded demo model (Qwen3.5 text + MTP head) on the stdlib's source."""
import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("train-demo", help="train the demo model (see specdec/demo_model/README.md)",
                       description="Train a small Qwen3.5-architecture model with its MTP head on the Python "
                                   "standard library; all options: specdec train-demo -- --help",
                       add_help=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="options of python -m specdec_tools.train.train_demo")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdec_tools.train.train_demo import main
    argv = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    main(argv)
    return 0
