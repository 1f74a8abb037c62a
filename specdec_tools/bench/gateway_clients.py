"""The bench's clients of a running gateway (gateway_path.py times them): N concurrent gRPC streams of one request
each, or N conversations, each a stream per turn, sent in order (turn t + 1 once turn t has finished, its prompt
turn t's prompt + the tokens turn t gave back + new user tokens)."""
from __future__ import annotations

import logging
import threading
import time

import grpc

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc

from .latency import RequestTrace, TurnRecord
from .workloads import Conversations, Workload

log = logging.getLogger(__name__)


def sampling_of(w: Workload, grammar: tuple[str, str] | None) -> dict:
    """SamplingParams fields of the workload's requests (ignore_eos: a grammar still ends where it ends)."""
    sampling = dict(max_tokens=w.max_tokens, temperature=w.temperature, ignore_eos=True)
    if grammar is not None:
        kind, text = grammar
        sampling["grammar"] = gateway_pb2.Grammar(**{kind: True if kind == "json_object" else text})
    return sampling


def connect(channel: grpc.Channel, address: str, timeout_s: float = 30.0) -> None:
    """Open the channel's connection before any request is timed: a client that keeps its connection open (as
    a real one does) would not pay the TCP and HTTP/2 handshakes in its first request's TTFT."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise RuntimeError(f"the gateway at {address} accepted no connection in {timeout_s:.0f} s") from None


def send_streams(address: str, w: Workload, prompts: list[list[int]], guard_s: float,
                 grammar: tuple[str, str] | None = None
                 ) -> tuple[list[RequestTrace], list[tuple[str, object]], bool]:
    """One request a stream, all at once (started together; with w.long_prompt the last is sent once the others
    decode): each stream's trace, its (finish reason, usage), and whether the guard cut the pass."""
    n = len(prompts)
    traces = [RequestTrace(sent=0.0) for _ in range(n)]
    finals: list[tuple[str, object]] = [("none", None)] * n
    calls: list = [None] * n
    barrier = threading.Barrier(n + 1)
    late = threading.Event()     # an interfering long prompt (the last) waits for it: set once the rest decode
    sampling = sampling_of(w, grammar)
    with grpc.insecure_channel(address) as channel:
        connect(channel, address)
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def stream(i: int) -> None:
            request = gateway_pb2.GenerateRequest(request_id=f"bench-{i}", prompt_token_ids=prompts[i],
                                                  sampling=gateway_pb2.SamplingParams(seed=i, **sampling))
            barrier.wait()
            if w.long_prompt and i == n - 1:
                late.wait(guard_s)
            traces[i].sent = time.perf_counter()
            calls[i] = stub.Generate(request, timeout=guard_s + 120)
            try:
                for reply in calls[i]:
                    traces[i].add(time.perf_counter(), len(reply.token_ids))
                    if reply.finish_reason:
                        finals[i] = (reply.finish_reason, reply.usage)
            except grpc.RpcError as e:
                finals[i] = (e.code().name.lower(), None)
                traces[i].error = f"{e.code().name}: {e.details()}"
                if i == 0:   # (the others' codes are in finish_reasons)
                    log.warning("%s: a request failed: %s: %s", w.name, e.code().name, e.details())
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        deadline = time.perf_counter() + guard_s
        if w.long_prompt:   # (a few deliveries each, well before their last)
            _when_decoding(traces[:-1], late, deadline, deliveries=max(1, min(16, w.max_tokens // 4)))
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()))
        truncated = any(t.is_alive() for t in threads)
        for call in calls if truncated else []:
            if call is not None:
                call.cancel()
        for t in threads:
            t.join(30)
    return traces, finals, truncated

def send_conversations(address: str, w: Workload, convs: Conversations, guard_s: float,
                       grammar: tuple[str, str] | None = None) -> tuple[list[TurnRecord], bool]:
    """w.concurrency conversations at once (started together), each sending its w.turns turns in order: a turn
    is sent when the last has finished, its prompt the last turn's prompt + the tokens it gave back + this
    turn's user tokens. A conversation stops at a turn that ends without a usage (an error status); at the
    guard, turns in flight are cancelled and no more are sent. Returns the records of the turns sent, and
    whether the guard cut the pass."""
    n = w.concurrency
    records: list[list[TurnRecord]] = [[] for _ in range(n)]
    calls: list = [None] * n
    barrier = threading.Barrier(n + 1)
    stop = threading.Event()
    sampling = sampling_of(w, grammar)
    with grpc.insecure_channel(address) as channel:
        connect(channel, address)
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def converse(c: int) -> None:
            history: list[int] = []
            barrier.wait()
            for turn in range(w.turns):
                if stop.is_set():
                    return
                prompt = convs.prompt(c, turn, history)
                request = gateway_pb2.GenerateRequest(
                    request_id=f"bench-c{c}-t{turn + 1}", prompt_token_ids=prompt,
                    sampling=gateway_pb2.SamplingParams(seed=c * w.turns + turn, **sampling))
                record = TurnRecord(c, turn + 1, len(prompt), RequestTrace(sent=time.perf_counter()))
                records[c].append(record)
                calls[c] = stub.Generate(request, timeout=guard_s + 120)
                output: list[int] = []
                try:
                    for reply in calls[c]:
                        record.trace.add(time.perf_counter(), len(reply.token_ids))
                        output += reply.token_ids
                        if reply.finish_reason:
                            record.finish_reason, record.usage = reply.finish_reason, reply.usage
                except grpc.RpcError as e:   # (after its last message: the turn is complete all the same)
                    record.finish_reason = record.finish_reason if record.usage else e.code().name.lower()
                    record.trace.error = None if record.usage else f"{e.code().name}: {e.details()}"
                    if not stop.is_set():
                        log.warning("%s: conversation %d, turn %d failed: %s: %s", w.name, c, turn + 1,
                                    e.code().name, e.details())
                if record.usage is None:
                    return
                history = prompt + output
        threads = [threading.Thread(target=converse, args=(c,), daemon=True) for c in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        deadline = time.perf_counter() + guard_s
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()))
        truncated = any(t.is_alive() for t in threads)
        stop.set()
        give_up = time.perf_counter() + 30
        while any(t.is_alive() for t in threads) and time.perf_counter() < give_up:
            for call in calls:       # (again: a turn may have been sent since the last round)
                if call is not None:
                    call.cancel()
            for t in threads:
                t.join(0.05)
    return [r for conv in records for r in conv], truncated


def _when_decoding(traces: list[RequestTrace], late: threading.Event, deadline: float,
                   deliveries: int = 16) -> None:
    """Set `late` once every trace has `deliveries` deliveries (their ITL before the long prompt has data), or at
    the deadline."""
    while time.perf_counter() < deadline and any(len(t.times) < deliveries for t in traces):
        time.sleep(0.002)
    late.set()
