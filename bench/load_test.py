"""Load test: N concurrent streaming clients send a fixed number of greedy requests to a gateway; every
request must complete, every output must equal its reference, the verifier must end with all KV blocks and
GDN slots free and nothing in flight, process memory must stay within a bound, and health must answer within
1 s throughout. Prints requests/s and latency percentiles.

    python bench/load_test.py                                  # starts the CPU stack on the demo model
    python bench/load_test.py --requests 2048 --concurrency 64 --max-tokens 32
    python bench/load_test.py --address HOST:PORT --verifier-address HOST:PORT   # a running stack
    python bench/load_test.py --device cuda --requests 2048 --max-tokens 64      # the GPU stack

References: without --address, each distinct prompt is first generated alone (one request at a time), so
the check is "the same output under load as unloaded"; the tests pass plain-decoding references instead.
Exit status 1 when anything above fails.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

HEALTH_LIMIT_S = 1.0


@dataclass
class Job:
    prompt: list[int]
    expected: list[int] | None = None


class HealthProbe(threading.Thread):
    """Checks health at each address every `interval_s`; an answer slower than 1 s (or none) is a failure."""

    def __init__(self, addresses: list[str], interval_s: float = 0.25):
        super().__init__(name="health-probe", daemon=True)
        self.addresses, self.interval_s = addresses, interval_s
        self.probes, self.worst_s, self.failures = 0, 0.0, []
        self._halt = threading.Event()

    def run(self) -> None:
        channels = [grpc.insecure_channel(a) for a in self.addresses]
        stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
        while not self._halt.wait(self.interval_s):
            for address, stub in zip(self.addresses, stubs):
                start = time.perf_counter()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_LIMIT_S)
                except grpc.RpcError as e:
                    self.failures.append(f"{address}: {e.code().name}")
                self.worst_s = max(self.worst_s, time.perf_counter() - start)
                self.probes += 1
        for c in channels:
            c.close()

    def stop(self) -> None:
        self._halt.set()
        self.join()


@dataclass
class LoadReport:
    requests: int
    concurrency: int
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)   # per completed request: submit → last message
    failures: list[str] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)      # job indices whose output differs from the reference
    tokens: int = 0
    health_probes: int = 0
    health_worst_s: float = 0.0
    health_failures: list[str] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    @property
    def ok(self) -> bool:
        return not (self.failures or self.mismatches or self.health_failures) and len(self.latencies_s) == self.requests

    def summary(self) -> str:
        return (f"{self.requests} requests, {self.concurrency} concurrent clients: {len(self.latencies_s)} completed, "
                f"{len(self.failures)} failed, {len(self.mismatches)} outputs differ from the reference; "
                f"{self.requests / self.wall_s:.1f} requests/s, {self.tokens / self.wall_s:.0f} tokens/s; latency "
                f"p50 {self.percentile(0.5):.2f} s, p99 {self.percentile(0.99):.2f} s, max {self.percentile(1):.2f} s; "
                f"health: {self.health_probes} probes, worst {self.health_worst_s * 1e3:.0f} ms, "
                f"{len(self.health_failures)} over {HEALTH_LIMIT_S:.0f} s")


async def _client(stub, jobs: list[Job], next_job, max_tokens: int, report: LoadReport, metadata, done) -> None:
    while (i := next_job()) is not None:
        job = jobs[i]
        request = gateway_pb2.GenerateRequest(prompt_token_ids=job.prompt, request_id=f"load-{i}",
                                              sampling=gateway_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True))
        start, tokens, last = time.perf_counter(), [], None
        try:
            async for reply in stub.Generate(request, metadata=metadata, timeout=600):
                tokens += reply.token_ids
                last = reply
        except grpc.aio.AioRpcError as e:
            report.failures.append(f"job {i}: {e.code().name}: {e.details()}")
            done()
            continue
        if last is None or last.finish_reason != "length" or last.usage.completion_tokens != len(tokens):
            report.failures.append(f"job {i}: ended with {last.finish_reason if last else 'nothing'!r}")
        elif job.expected is not None and tokens != job.expected:
            report.mismatches.append(i)
        report.latencies_s.append(time.perf_counter() - start)
        report.tokens += len(tokens)
        done()


async def _run_clients(address: str, jobs: list[Job], concurrency: int, max_tokens: int, report: LoadReport,
                       metadata, progress: bool) -> None:
    from tqdm import tqdm
    order = iter(range(len(jobs)))
    bar = tqdm(total=len(jobs), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(_client(stub, jobs, lambda: next(order, None), max_tokens, report, metadata,
                                       lambda: bar.update(1)) for _ in range(concurrency)))
    bar.close()


def run_load(address: str, jobs: list[Job], concurrency: int, max_tokens: int, health_addresses: list[str] = (),
             metadata=(), progress: bool = False) -> LoadReport:
    """Send `jobs` through `concurrency` streaming clients while probing health; return what happened."""
    report = LoadReport(len(jobs), concurrency)
    probe = HealthProbe(list(health_addresses) or [address])
    probe.start()
    start = time.perf_counter()
    try:
        asyncio.run(_run_clients(address, jobs, concurrency, max_tokens, report, metadata, progress))
    finally:
        report.wall_s = time.perf_counter() - start
        probe.stop()
    report.health_probes, report.health_worst_s, report.health_failures = probe.probes, probe.worst_s, probe.failures
    return report


def leaks(verifier_address: str) -> list[str]:
    """What the verifier still holds once every request ended (nothing, when nothing leaks)."""
    with grpc.insecure_channel(verifier_address) as channel:
        s = verifier_pb2_grpc.VerifierStub(channel).Stats(verifier_pb2.StatsRequest(), timeout=10)
    problems = []
    taken = s.total_kv_blocks - s.free_kv_blocks - s.prefix_cache_checkpoints   # (checkpoints keep a block each)
    if taken:
        problems.append(f"{taken} KV blocks still taken")
    if s.free_gdn_slots != s.total_gdn_slots:
        problems.append(f"{s.total_gdn_slots - s.free_gdn_slots} GDN slots still taken")
    if s.running or s.waiting or s.in_flight:
        problems.append(f"running {s.running}, waiting {s.waiting}, in flight {s.in_flight}")
    return problems


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def make_jobs(prompts: list[list[int]], expected: list[list[int]] | None, num_requests: int) -> list[Job]:
    return [Job(prompts[i % len(prompts)], expected[i % len(prompts)] if expected else None)
            for i in range(num_requests)]


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(4, 48))] for _ in range(count)]


def sequential_references(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return [[t for r in stub.Generate(gateway_pb2.GenerateRequest(
            prompt_token_ids=p, sampling=gateway_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
            timeout=300) for t in r.token_ids] for p in prompts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--address", default=None, help="gateway HOST:PORT (default: start a local stack)")
    p.add_argument("--verifier-address", default=None, help="verifier HOST:PORT, for the leak check")
    p.add_argument("--model", default=None, help="model folder for the started stack (default: the demo model)")
    p.add_argument("--drafter", default="mtp", help="drafter of the started stack (mtp | ngram | none)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device of the started stack")
    p.add_argument("--dtype", default=None, help="dtype of the started stack (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--requests", type=int, default=512, help="requests in all (each client takes the next one)")
    p.add_argument("--concurrency", type=int, default=64, help="streaming clients at once")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (greedy, ignore_eos)")
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (requests cycle over them)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--rss-growth-mb", type=float, default=300.0,
                   help="largest RSS growth allowed per service from after the reference pass to the end")
    args = p.parse_args(argv)
    if args.address:
        return _report(args, args.address, args.verifier_address, {})
    from specdec.demo import demo_model_dir
    from specdec_tools.local_stack import LocalStack, StackConfig
    with tempfile.TemporaryDirectory(prefix="specdec-load-") as logs:
        dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
        stack = LocalStack(StackConfig(model=args.model or demo_model_dir(), drafter=args.drafter, port=0,
                                       device=args.device, dtype=dtype, log_dir=logs))
        print(f"starting the local stack ({args.drafter} drafter; logs in {logs}) ...", file=sys.stderr, flush=True)
        stack.start()
        try:
            pids = {name: proc.pid for name, proc in stack.procs.items()}
            return _report(args, stack.address, f"127.0.0.1:{stack.ports['verifier']}", pids)
        finally:
            stack.stop()


def _report(args, address: str, verifier_address: str | None, pids: dict[str, int]) -> int:
    with grpc.insecure_channel(address) as channel:
        vocab = gateway_pb2_grpc.GatewayStub(channel).Info(gateway_pb2.InfoRequest(), timeout=30).vocab_size
    prompts = random_prompts(args.prompts, vocab, args.seed)
    print(f"references: {len(prompts)} prompts, one at a time ...", file=sys.stderr, flush=True)
    expected = sequential_references(address, prompts, args.max_tokens)
    rss_before = {name: rss_mb(pid) for name, pid in pids.items()}
    report = run_load(address, make_jobs(prompts, expected, args.requests), args.concurrency, args.max_tokens,
                      [address] + ([verifier_address] if verifier_address else []), progress=True)
    print(report.summary())
    for failure in report.failures[:10]:
        print("  failure:", failure)
    problems = leaks(verifier_address) if verifier_address else []
    for name, pid in pids.items():
        grown = rss_mb(pid) - rss_before[name]
        print(f"{name} RSS {rss_before[name]:.0f} MB -> {rss_before[name] + grown:.0f} MB ({grown:+.0f} MB)")
        if grown > args.rss_growth_mb:
            problems.append(f"{name} RSS grew {grown:.0f} MB (bound {args.rss_growth_mb:.0f} MB)")
    print("leaks: " + ("; ".join(problems) if problems else "none (KV blocks and GDN slots all free, nothing in flight)"))
    return 0 if report.ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
