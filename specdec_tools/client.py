"""A terminal client of the Gateway: streams text (or token ids) as it arrives, then usage and acceptance.
Errors are one line on stderr (exit code 1), never a traceback."""
from __future__ import annotations

import argparse
import sys
import time

import grpc

from specdec.rpc.security import ClientSecurity
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc


def request_from_args(args: argparse.Namespace, ids: list[int] | None) -> gateway_pb2.GenerateRequest:
    sampling = gateway_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.no_speculation:
        sampling.speculation = False
    if ids is not None:
        return gateway_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
    return gateway_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling)


def stream_completion(address: str, args: argparse.Namespace, ids: list[int] | None,
                      security: ClientSecurity = ClientSecurity()) -> int:
    written: list[bool] = []  # whether anything went to stdout (then the error starts on a new line)
    try:
        with security.channel(address) as channel:
            return _stream(gateway_pb2_grpc.GatewayStub(channel), args, ids, security.metadata(), written)
    except grpc.RpcError as e:
        print(f"{chr(10) if written else ''}specdec generate: error from {address}: {e.code().name}: "
              f"{e.details()}", file=sys.stderr)
        return 1


def _stream(stub: gateway_pb2_grpc.GatewayStub, args: argparse.Namespace, ids: list[int] | None, metadata,
            written: list[bool]) -> int:
    info = stub.Info(gateway_pb2.InfoRequest(), timeout=10, metadata=metadata)
    start, first, last = time.perf_counter(), None, None
    if args.prompt is not None and ids is None:
        sys.stdout.write(args.prompt)
        written.append(True)
    for reply in stub.Generate(request_from_args(args, ids), metadata=metadata):
        first = first or time.perf_counter()
        sys.stdout.write(reply.text if info.has_tokenizer else "".join(f" {t}" for t in reply.token_ids))
        sys.stdout.flush()
        last = reply
    elapsed = time.perf_counter() - start
    u = last.usage
    rate = u.accepted_tokens / u.draft_tokens if u.draft_tokens else 0.0
    length = (u.completion_tokens - 1) / u.verify_steps if u.verify_steps else 1.0
    print(f"\n\n[{info.model} | drafter {info.drafter_kind}, k={info.num_draft_tokens} | finish: {last.finish_reason}]"
          f"\n[usage: {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens; "
          f"{u.draft_tokens} drafted, {u.accepted_tokens} accepted ({rate:.0%}); {u.verify_steps} verify steps; "
          f"mean acceptance length {length:.2f}]"
          f"\n[{elapsed:.2f} s, first token after {(first - start) if first else 0:.2f} s, "
          f"{u.completion_tokens / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0
