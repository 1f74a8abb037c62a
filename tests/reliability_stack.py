"""Helpers of the reliability / security / load tests: real processes on 127.0.0.1, real gRPC clients."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_tools.local_stack import LocalStack, StackConfig, services_of
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
SERVING = health_pb2.HealthCheckResponse.SERVING


def tiny_with_tokenizer(folder: Path) -> str:
    from specdec_tools.tiny import make_tiny
    return str(make_tiny(folder, overrides={"vocab_size": 400}, tokenizer=True, progress=False))


def references(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy plain decoding in this process: what every stream must equal."""
    from engine_factory import make_engine

    from specdec.models.loader import load_model
    from specdec.sampling_params import SamplingParams
    engine = make_engine(load_model(model_dir), num_blocks=1024)
    return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def start_stack(model_dir: str, log_dir: Path, drafter: str = "ngram", verifier_args: tuple = (),
                transport: str = "auto") -> LocalStack:
    stack = LocalStack(StackConfig(model=model_dir, drafter=drafter, num_drafts=3, port=0, transport=transport,
                                   verifier_args=verifier_args, log_dir=str(log_dir), startup_timeout_s=180))
    stack.start()
    return stack


def greedy_request(ids: list[int], max_tokens: int, **fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt_token_ids=ids, sampling=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True), **fields)


def generate(stub, ids: list[int], max_tokens: int, timeout: float = 120, metadata=(), **fields):
    replies = list(stub.Generate(greedy_request(ids, max_tokens, **fields), timeout=timeout, metadata=metadata))
    return [t for r in replies for t in r.token_ids], replies


def verifier_stats(stack: LocalStack) -> verifier_pb2.StatsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['verifier']}") as channel:
        return verifier_pb2_grpc.VerifierStub(channel).Stats(verifier_pb2.StatsRequest(), timeout=10)


def assert_no_leak(stack: LocalStack) -> None:
    s = verifier_stats(stack)
    # (the prefix cache's checkpoints keep a block each; its idle cached blocks count as free)
    assert (s.free_kv_blocks + s.prefix_cache_checkpoints, s.free_gdn_slots) == (s.total_kv_blocks, s.total_gdn_slots), s
    assert (s.running, s.waiting, s.in_flight) == (0, 0, 0) and s.engine_alive, s


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout:.0f}s"
        time.sleep(0.1)


def health(address: str, timeout: float = 1.0, credentials=None) -> int:
    """The health status at `address` (raises grpc.RpcError when nothing answers in time)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def answers_health(address: str, credentials=None) -> bool:
    try:
        health(address, credentials=credentials)
        return True
    except grpc.RpcError:
        return False


def spawn_gateway(verifier_address: str, port: int, log_path: Path, *extra: str, env=None) -> subprocess.Popen:
    """A gateway process of its own (security tests), dying with this process like the stack's children."""
    cmd = [sys.executable, "-m", "specdec", "--parent-pid", str(os.getpid()), "gateway", "--verifier-address",
           verifier_address, "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


children = services_of   # serve's services by name


def state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


class Serve:
    """`specdec serve` as a process of its own, its log in tmp_path/serve.log; `address`: the gateway's."""

    def __init__(self, model: str, tmp_path: Path, *extra: str):
        self.log = tmp_path / "serve.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec", "serve", "--model", model, "--device", "cpu", "--port", "0", *extra],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: "specdec serving" in self.text() or self.proc.poll() is not None, 180, "stack serving")
        assert self.proc.poll() is None, self.text()
        self.address = re.search(r"on (127\.0\.0\.1:\d+)", self.text()).group(1)

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        kids = list(children(self.proc.pid).values()) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        for pid in kids:
            if state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)


def http_status(url: str, payload: dict | None = None) -> int | None:
    """The HTTP status of a GET (or, with `payload`, a JSON POST) to `url`; None when nothing answers."""
    data = json.dumps(payload).encode() if payload is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, {"Content-Type": "application/json"}),
                                    timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None
