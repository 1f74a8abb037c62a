"""Faults under load (issue 13, faults): a drafter killed and restarted repeatedly, a drafter that stalls past
its deadline, a verifier killed and restarted, 1000 cancelled clients. No request fails because of the
drafter, outputs stay identical to plain decoding, speculation resumes, nothing leaks; a dead verifier fails
its streams with UNAVAILABLE at once and the gateway serves again once it is back."""
import asyncio
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from reliability_stack import (REPO, SERVING, assert_no_leak, generate, greedy_request, health, references,
                               start_stack, tiny_with_tokenizer, verifier_stats, wait_for)

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc

sys.path.append(str(REPO / "bench"))   # after the packages: bench/kernels.py must not hide kernels/
from load_test import make_jobs, random_prompts, run_load  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS, CLIENTS, ROUND = 32, 32, 64
REPETITIVE = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def workload(model_dir):
    prompts = random_prompts(16, 400, seed=3) + [REPETITIVE]
    return prompts, references(model_dir, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"), "mtp", ("--drafter-timeout", "1"), transport="shm")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def load_in_background(stack, workload, requests=ROUND):
    prompts, expected = workload
    box = {}
    worker = threading.Thread(target=lambda: box.update(report=run_load(
        stack.address, make_jobs(prompts, expected, requests), CLIENTS, MAX_TOKENS)))
    worker.start()
    wait_for(lambda: verifier_stats(stack).in_flight >= CLIENTS // 2, 60, "load under way")
    return worker, box


def assert_clean(worker, box):
    worker.join(300)
    report = box["report"]
    assert not report.failures, report.failures[:5]
    assert not report.mismatches and len(report.latencies_s) == report.requests, report.summary()


def drafts_again(stack, stub) -> None:
    wait_for(lambda: verifier_stats(stack).drafter_connected, 60, "drafter reconnected")
    assert generate(stub, REPETITIVE, MAX_TOKENS)[1][-1].usage.draft_tokens > 0  # speculation resumed


def test_drafter_killed_and_restarted_three_times_under_load(stack, stub, workload):
    before = verifier_stats(stack).drafter_fallbacks
    for _ in range(3):
        worker, box = load_in_background(stack, workload)
        stack.kill("drafter")
        stack.restart("drafter")
        assert_clean(worker, box)
        drafts_again(stack, stub)
    assert verifier_stats(stack).drafter_fallbacks > before
    assert_no_leak(stack)


def test_stalled_drafter_hits_its_deadline_and_steps_decode_without_drafts(stack, stub, workload):
    drafter = stack.procs["drafter"]
    before = verifier_stats(stack)
    worker, box = load_in_background(stack, workload)
    os.kill(drafter.pid, signal.SIGSTOP)  # an injected delay longer than --drafter-timeout 1
    try:
        time.sleep(2.5)
        stalled = verifier_stats(stack)
    finally:
        os.kill(drafter.pid, signal.SIGCONT)
    assert stalled.verify_steps > before.verify_steps  # decoding went on while the drafter was stuck
    assert_clean(worker, box)
    assert verifier_stats(stack).drafter_fallbacks > before.drafter_fallbacks
    assert "timed out" in (Path(stack.config.log_dir) / "verifier.log").read_text()
    drafts_again(stack, stub)
    assert_no_leak(stack)


def test_verifier_killed_then_back(stack, stub, workload):
    prompts, expected = workload
    errors, done = [], threading.Event()

    def stream(i):
        try:
            list(stub.Generate(greedy_request(prompts[i], 3000), timeout=120))
        except grpc.RpcError as e:
            errors.append((e.code(), e.details(), time.monotonic()))
        if len(errors) == 8:
            done.set()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    wait_for(lambda: verifier_stats(stack).in_flight == 8, 60, "streams under way")
    killed = time.monotonic()
    stack.kill("verifier")
    assert done.wait(10), f"only {len(errors)} of 8 streams ended after the verifier died"
    assert {code for code, _, _ in errors} == {grpc.StatusCode.UNAVAILABLE}, errors[:2]
    assert max(t for _, _, t in errors) - killed < 5.0  # promptly, not at a deadline
    wait_for(lambda: health(stack.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "gateway NOT_SERVING")
    with pytest.raises(grpc.RpcError) as error:
        generate(stub, prompts[0], 4, timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    stack.restart("verifier")
    wait_for(lambda: health(stack.address) == SERVING, 30, "gateway SERVING again")
    assert generate(stub, prompts[0], MAX_TOKENS)[0] == expected[0]
    assert_no_leak(stack)


async def _cancelled_clients(address: str, prompts, count: int, concurrency: int) -> int:
    rng = random.Random(7)
    order = iter(range(count))
    cancelled = 0

    async def client(stub):
        nonlocal cancelled
        while (i := next(order, None)) is not None:
            call = stub.Generate(greedy_request(prompts[i % len(prompts)], 2000, request_id=f"cancel-{i}"))
            after = rng.choice([0, 0, 1, 3])  # messages read before cancelling (0: before the first one)
            if after == 0:
                await asyncio.sleep(rng.random() * 0.02)
            for _ in range(after):
                await call.read()
            call.cancel()
            cancelled += 1
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(concurrency)))
    return cancelled


def test_1000_cancelled_clients_leak_nothing(stack, stub, workload):
    prompts, expected = workload
    assert asyncio.run(_cancelled_clients(stack.address, prompts, 1000, CLIENTS)) == 1000
    wait_for(lambda: verifier_stats(stack).in_flight == 0, 60, "cancelled requests gone")
    assert_no_leak(stack)
    for i in range(0, 1000, 97):  # the gateway forgot every cancelled id: each can be used again
        tokens, replies = generate(stub, prompts[i % len(prompts)], MAX_TOKENS, request_id=f"cancel-{i}")
        assert replies[-1].finish_reason == "length" and tokens == expected[i % len(prompts)]
