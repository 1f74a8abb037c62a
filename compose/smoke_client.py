"""The gRPC client of compose/smoke.sh: asks a running gateway what drafter it has, and streams greedy completions.

Runs wherever the `specdec` package (without torch) is installed; compose/smoke.sh runs it in the gateway image
on the host network, so it goes through the gateway's published port as any outside client does.

  python compose/smoke_client.py wait-drafter 127.0.0.1:50051 ngram --timeout 120
  python compose/smoke_client.py generate 127.0.0.1:50051 "def fibonacci(n):" --max-tokens 48 --drafts required

`generate` prints the completion's token ids as one comma-separated line on stdout (the caller compares them
between phases) and a human-readable report on stderr; it exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import grpc

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc


def info(stub: gateway_pb2_grpc.GatewayStub) -> gateway_pb2.InfoResponse:
    return stub.Info(gateway_pb2.InfoRequest(), timeout=10)


def wait_drafter(stub: gateway_pb2_grpc.GatewayStub, kind: str, timeout: float) -> int:
    """Polls Info until the verifier reports drafter `kind` ("none": no drafter connected)."""
    deadline, seen = time.monotonic() + timeout, None
    while True:
        try:
            seen = info(stub).drafter_kind
        except grpc.RpcError as e:
            seen = f"({e.code().name})"
        if seen == kind:
            print(f"smoke-client: drafter {kind!r} reported", file=sys.stderr)
            return 0
        if time.monotonic() > deadline:
            print(f"smoke-client: error: drafter {kind!r} not reported within {timeout:.0f} s (last: {seen!r})",
                  file=sys.stderr)
            return 1
        time.sleep(0.5)


def generate(stub: gateway_pb2_grpc.GatewayStub, args: argparse.Namespace) -> int:
    """One greedy streamed completion; checks that it streamed, ended by length, and drafted as `--drafts` says."""
    kind = info(stub).drafter_kind
    request = gateway_pb2.GenerateRequest(prompt=args.prompt, sampling=gateway_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    replies = list(stub.Generate(request, timeout=args.timeout))
    elapsed = time.perf_counter() - start
    ids = [t for r in replies for t in r.token_ids]
    text = "".join(r.text for r in replies)
    u = replies[-1].usage
    print(f"smoke-client: drafter {kind}: {len(ids)} tokens in {len(replies)} messages, {elapsed:.2f} s; "
          f"{u.draft_tokens} drafted, {u.accepted_tokens} accepted, {u.verify_steps} verify steps; "
          f"finish {replies[-1].finish_reason}; text {text!r}", file=sys.stderr)
    failures = []
    if replies[-1].finish_reason != "length" or len(ids) != args.max_tokens:
        failures.append(f"expected {args.max_tokens} tokens ending by length, got {len(ids)} "
                        f"({replies[-1].finish_reason!r})")
    if len(replies) < 2:
        failures.append("the completion came in one message: nothing was streamed")
    if args.drafts == "required" and u.draft_tokens == 0:
        failures.append(f"drafter {kind} proposed no draft")
    if args.drafts == "none" and u.draft_tokens != 0:
        failures.append(f"{u.draft_tokens} drafts with no drafter")
    for failure in failures:
        print(f"smoke-client: error: {failure}", file=sys.stderr)
    print(",".join(map(str, ids)))
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait-drafter", help="wait until the gateway's Info reports a drafter kind")
    wait.add_argument("address", help="HOST:PORT of the gateway")
    wait.add_argument("kind", help='drafter kind to wait for: mtp | ngram | none')
    wait.add_argument("--timeout", type=float, default=120.0, help="seconds (default 120)")
    gen = sub.add_parser("generate", help="stream one greedy completion; token ids on stdout")
    gen.add_argument("address", help="HOST:PORT of the gateway")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--drafts", choices=["required", "none", "any"], default="any",
                     help="required: fail unless the drafter proposed drafts; none: fail if it did (default any)")
    gen.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole stream (default 120)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            if args.command == "wait-drafter":
                return wait_drafter(stub, args.kind, args.timeout)
            return generate(stub, args)
        except grpc.RpcError as e:
            print(f"smoke-client: error: {args.command}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
