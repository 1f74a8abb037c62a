"""Soak test: `specdec serve` under streaming clients for minutes while its drafter is killed every few seconds and
its verifier once, with serve supervising (restarting them). Checks, and exits 1 when one fails:
  - every request ends with a finish reason or a clear gRPC status (UNAVAILABLE while the verifier restarts), and
    its tokens are the reference's (all of them when it finished, a prefix when it was cut off): drafter kills
    never change a greedy output;
  - no growth beyond the bounds of the stack's open files, memory (RSS of serve and its services) or shared-memory
    files, between a warm round at the start and the end (services restarted meanwhile are counted as they are);
  - the verifier ends with every KV block and GDN slot free and nothing in flight.

    python bench/soak.py                                      # 10 minutes, 32 clients, the demo model on the CPU
    python bench/soak.py --minutes 1 --kill-drafter-every 15  # quicker
References are each prompt generated alone through the same stack before the first kill. Prints a summary.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.append(str(Path(__file__).resolve().parent))   # load_test beside this file (appended: bench/ shadows nothing)
from load_test import leaks, random_prompts, rss_mb, sequential_references  # noqa: E402

from specdec.rpc.health_probe import is_serving  # noqa: E402
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from specdec_tools.local_stack import services_of as services  # noqa: E402

@dataclass
class Usage:
    """What the stack holds: open files, memory, shared-memory files."""
    fds: int
    rss_mb: float
    shm_files: int

    @staticmethod
    def of(serve_pid: int) -> "Usage":
        pids = [serve_pid, *services(serve_pid).values()]
        return Usage(sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids), sum(rss_mb(p) for p in pids),
                     len(list(Path("/dev/shm").glob("specdec-*"))))


@dataclass
class Outcomes:
    by_end: collections.Counter = field(default_factory=collections.Counter)  # "finish length", "UNAVAILABLE"...
    unclear: list[str] = field(default_factory=list)     # ended with neither a finish reason nor a status
    differ: list[str] = field(default_factory=list)      # tokens that are not the reference's (or a prefix)
    unavailable_at: list[float] = field(default_factory=list)   # when UNAVAILABLE came (monotonic seconds)
    tokens: int = 0


async def client(stub, prompts, expected, max_tokens: int, deadline: float, outcomes: Outcomes, seed: int) -> None:
    i = seed
    while time.monotonic() < deadline:
        i = (i + 7) % len(prompts)
        tokens, last = [], None
        request = gateway_pb2.GenerateRequest(prompt_token_ids=prompts[i], sampling=gateway_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))
        try:
            async for reply in stub.Generate(request, timeout=120):
                tokens += reply.token_ids
                last = reply
            end = f"finish {last.finish_reason}" if last is not None and last.finish_reason else "no finish reason"
            if end == "no finish reason":
                outcomes.unclear.append(f"prompt {i}: the stream ended without a finish reason")
        except grpc.aio.AioRpcError as e:
            end = e.code().name
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                outcomes.unavailable_at.append(time.monotonic())
                await asyncio.sleep(0.2)   # the verifier is restarting: as a client would, retry shortly
        except Exception as e:   # noqa: BLE001 (anything that is not a gRPC status is a failure to report)
            end = "unclear"
            outcomes.unclear.append(f"prompt {i}: {type(e).__name__}: {e}")
        outcomes.by_end[end] += 1
        outcomes.tokens += len(tokens)
        complete = end == "finish length"
        if (complete and tokens != expected[i]) or tokens != expected[i][:len(tokens)]:
            outcomes.differ.append(f"prompt {i} ({end}): {len(tokens)} tokens differ from the reference")


async def load(address: str, prompts, expected, clients: int, max_tokens: int, seconds: float) -> Outcomes:
    outcomes, deadline = Outcomes(), time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(client(stub, prompts, expected, max_tokens, deadline, outcomes, c)
                               for c in range(clients)))
    return outcomes


class Killer(threading.Thread):
    """SIGKILLs serve's drafter every `every_s` and its verifier once, at `verifier_at_s` (from the start)."""

    def __init__(self, serve_pid: int, every_s: float, verifier_at_s: float, seconds: float):
        super().__init__(name="killer", daemon=True)
        self.serve_pid, self.every_s, self.verifier_at_s, self.seconds = serve_pid, every_s, verifier_at_s, seconds
        self.kills: list[tuple[float, str, int]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        next_drafter, verifier_done = start + self.every_s, False
        while not self._halt.wait(0.1) and time.monotonic() - start < self.seconds:
            now = time.monotonic()
            if not verifier_done and now - start >= self.verifier_at_s:
                verifier_done = self._kill("verifier", now - start)
            if now >= next_drafter:
                self._kill("drafter", now - start)
                next_drafter += self.every_s

    def _kill(self, name: str, at: float) -> bool:
        pid = services(self.serve_pid).get(name)
        if pid is None:   # being restarted: the next round takes it
            return False
        os.kill(pid, signal.SIGKILL)
        self.kills.append((at, name, pid))
        return True

    def stop(self) -> None:
        self._halt.set()
        self.join()


def wait_serving(addresses: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(is_serving(a, timeout=1.0) for a in addresses):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{addresses} not all SERVING after {timeout_s:.0f} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=32, help="streaming clients at once")
    p.add_argument("--kill-drafter-every", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--kill-verifier-at", type=float, default=0.5, metavar="FRACTION",
                   help="kill the verifier once, this far into the run (default halfway)")
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--drafter", default="mtp")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (greedy, ignore_eos)")
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (random ids)")
    p.add_argument("--fd-growth", type=int, default=64, help="bound on the stack's open files' growth")
    p.add_argument("--rss-growth-mb", type=float, default=400.0, help="bound on the stack's memory growth")
    p.add_argument("--shm-growth", type=int, default=0, help="bound on the growth of /dev/shm/specdec-* files")
    p.add_argument("--log", default=None, help="serve's log file (default: a temporary one)")
    args = p.parse_args(argv)
    seconds = args.minutes * 60
    log = Path(args.log or tempfile.mkstemp(prefix="specdec-soak-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "specdec", "serve", "--device", "cpu", "--port", "0", "--drafter", args.drafter]
    cmd += ["--model", args.model] if args.model else []
    serve = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (found := re.search(r"specdec serving .* on (127\.0\.0\.1:\d+)", log.read_text())):
            if serve.poll() is not None or time.monotonic() > deadline:
                print(f"serve did not start (see {log})", file=sys.stderr)
                return 1
            time.sleep(0.2)
        address = found.group(1)
        verifier = "127.0.0.1:" + re.search(r"verifier .* listening on 127\.0\.0\.1:(\d+); at most",
                                             log.read_text()).group(1)
        with grpc.insecure_channel(address) as channel:
            vocab = gateway_pb2_grpc.GatewayStub(channel).Info(gateway_pb2.InfoRequest(), timeout=30).vocab_size
        prompts = random_prompts(args.prompts, vocab, seed=0)
        print(f"serve at {address} (log {log}); references: {len(prompts)} prompts, one at a time ...", flush=True)
        expected = sequential_references(address, prompts, args.max_tokens)
        warm = asyncio.run(load(address, prompts, expected, args.clients, args.max_tokens, 5.0))
        before = Usage.of(serve.pid)
        killer = Killer(serve.pid, args.kill_drafter_every, args.kill_verifier_at * seconds, seconds)
        start = time.monotonic()
        killer.start()
        outcomes = asyncio.run(load(address, prompts, expected, args.clients, args.max_tokens, seconds))
        killer.stop()
        wall = time.monotonic() - start
        wait_serving([address, verifier], 120)
        time.sleep(2.0)   # the gateway's and verifier's last cancelled calls settle
        after = Usage.of(serve.pid)
        problems = leaks(verifier) + warm.unclear + warm.differ + outcomes.unclear + outcomes.differ
        for what, grew, bound in (("open files", after.fds - before.fds, args.fd_growth),
                                  ("RSS MB", after.rss_mb - before.rss_mb, args.rss_growth_mb),
                                  ("shared-memory files", after.shm_files - before.shm_files, args.shm_growth)):
            if grew > bound:
                problems.append(f"{what} grew by {grew:.0f} (bound {bound})")
        restarts = len(re.findall(r"is back and healthy", log.read_text()))
        print(f"soak: {wall:.0f} s, {args.clients} clients, {sum(outcomes.by_end.values())} requests "
              f"({outcomes.tokens} tokens): " + ", ".join(f"{n} {end}" for end, n in outcomes.by_end.most_common()))
        print(f"kills: {sum(k[1] == 'drafter' for k in killer.kills)} drafter, "
              f"{sum(k[1] == 'verifier' for k in killer.kills)} verifier; serve restarted {restarts} service(s)")
        if outcomes.unavailable_at:   # clients retry every 0.2 s while the verifier is away
            first, last = (t - start for t in (min(outcomes.unavailable_at), max(outcomes.unavailable_at)))
            verifier_kill = next((at for at, name, _ in killer.kills if name == "verifier"), None)
            print(f"UNAVAILABLE answers from {first:.1f} s to {last:.1f} s"
                  + (f" (the verifier was killed at {verifier_kill:.1f} s)" if verifier_kill is not None else ""))
        print(f"outputs differing from the reference: {len(outcomes.differ)}; ended unclearly: "
              f"{len(outcomes.unclear)}")
        print(f"stack: open files {before.fds} -> {after.fds}, RSS {before.rss_mb:.0f} -> {after.rss_mb:.0f} MB, "
              f"shared-memory files {before.shm_files} -> {after.shm_files}")
        print("problems: " + ("; ".join(problems[:10]) if problems else "none"))
        return 1 if problems or not killer.kills else 0
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)


if __name__ == "__main__":
    sys.exit(main())
