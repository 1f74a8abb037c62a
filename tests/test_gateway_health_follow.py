"""The gateway's health follows the verifier's at once (issue 34, defect 1). It polled the verifier every 1 s
(2 s timeout): a probe 0.1 s after a `kill -9` of the verifier still said SERVING, and the flip came up to a poll
interval (or a timeout) later. Now a real verifier process killed with SIGKILL turns the gateway NOT_SERVING
within 1 s, requests meanwhile get UNAVAILABLE (HTTP 503), the restarted verifier makes it SERVING again, and a
verifier that hangs with its connection open still turns it NOT_SERVING. A live verifier turning NOT_SERVING just
after it answered a health check (the worst moment for a poller) is followed within 1 s too."""
import os
import signal
import time

import grpc
import pytest
from fake_verifier import FakeVerifier, Loop, serve
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reliability_stack import http_status

from gateway.server import GatewayConfig, start
from specdec_tools.local_stack import LocalStack, StackConfig
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(300)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
FLIP_BOUND_S = 1.0                      # the defect's bound: NOT_SERVING within 1 s of the verifier's death
REQUEST = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 17, 3], sampling=gateway_pb2.SamplingParams(max_tokens=4))


def first_time(predicate, every: float = 0.05, give_up: float = 30.0) -> float | None:
    """time.monotonic() when `predicate` first held, polling every `every` s; None if not within `give_up`."""
    deadline = time.monotonic() + give_up
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(every)
    return None


class Gateway:
    """Health of a gateway, probed over one channel (each probe one round trip, 0.5 s deadline)."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.health, self.stub = health_pb2_grpc.HealthStub(self.channel), gateway_pb2_grpc.GatewayStub(self.channel)

    def status(self) -> int | None:
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status
        except grpc.RpcError:
            return None


def test_health_turns_not_serving_within_1s_of_a_verifier_kill_and_back(tiny_dir, tmp_path):
    """Verifier and gateway as `specdec serve` runs them (no drafter): SIGKILL, restart, SIGSTOP / SIGCONT."""
    stack = LocalStack(StackConfig(model=str(tiny_dir), drafter="none", port=0, http_port=0, log_dir=str(tmp_path),
                                   startup_timeout_s=180))
    stack.start()
    try:
        gateway = Gateway(stack.address)
        assert gateway.status() == SERVING
        assert list(gateway.stub.Generate(REQUEST, timeout=60))[-1].usage.completion_tokens == 4
        killed = time.monotonic()
        stack.kill("verifier")                                      # SIGKILL, and reaped
        flipped = first_time(lambda: gateway.status() == NOT_SERVING)
        assert flipped is not None, "the gateway never turned NOT_SERVING"
        assert flipped - killed < FLIP_BOUND_S, f"NOT_SERVING {flipped - killed:.2f}s after the kill"
        with pytest.raises(grpc.RpcError) as error:
            list(gateway.stub.Generate(REQUEST, timeout=30))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "verifier" in error.value.details()
        base = stack.http_url.removesuffix("/v1")
        assert http_status(base + "/health") == 503
        assert http_status(stack.http_url + "/completions", {"prompt": [5, 17, 3], "max_tokens": 4}) == 503
        stack.restart("verifier")                                   # returns once the verifier reports SERVING
        assert first_time(lambda: gateway.status() == SERVING) is not None, "the gateway never turned SERVING again"
        assert http_status(base + "/health") == 200
        assert list(gateway.stub.Generate(REQUEST, timeout=60))[-1].usage.completion_tokens == 4
        assert gateway.stub.Info(gateway_pb2.InfoRequest(), timeout=10).max_context > 0
        # a verifier that hangs (stopped, its connection open: no stream breaks) is caught by the health checks
        os.kill(stack.procs["verifier"].pid, signal.SIGSTOP)
        try:
            hung = first_time(lambda: gateway.status() == NOT_SERVING, give_up=12)   # ~3 s: a check's deadline
            assert hung is not None, "a hung verifier went unnoticed"
        finally:
            os.kill(stack.procs["verifier"].pid, signal.SIGCONT)
        assert first_time(lambda: gateway.status() == SERVING) is not None, "the gateway never turned SERVING again"
        gateway.channel.close()
        log = (tmp_path / "gateway.log").read_text()
        assert "gateway NOT_SERVING until it is back" in log and log.count("gateway SERVING") >= 3, log
    finally:
        stack.stop()


class TurnsNotServingAfterACheck(health_aio.HealthServicer):
    """Health that, once armed, answers a Check with SERVING and turns NOT_SERVING right after: the worst moment
    for a poller, whose next look is a whole interval away. `turned_at`: when it did (time.monotonic())."""

    def __init__(self):
        super().__init__()
        self.armed, self.turned_at = False, None

    async def Check(self, request, context):
        reply = await super().Check(request, context)
        if self.armed and reply.status == SERVING:
            await self.turn()
        return reply

    async def turn(self) -> None:
        self.armed = False
        await self.set("", NOT_SERVING)
        self.turned_at = time.monotonic()


def test_a_live_verifier_turning_not_serving_is_followed_within_1s():
    """An engine failure turns the verifier NOT_SERVING while its process lives on: the gateway must follow within
    1 s whenever it happens. Were the gateway to make no Check of its own, the test turns it after 2 s."""
    loop, health = Loop(), TurnsNotServingAfterACheck()
    try:
        server, port = loop.run(serve(FakeVerifier(), health))
        running = loop.run(start(GatewayConfig(None, f"127.0.0.1:{port}", port=0), None))
        gateway = Gateway(f"127.0.0.1:{running.grpc_server.port}")
        assert first_time(lambda: gateway.status() == SERVING) is not None
        health.armed = True
        if first_time(lambda: health.turned_at is not None, give_up=2.0) is None:
            loop.run(health.turn())
        flipped = first_time(lambda: gateway.status() == NOT_SERVING)
        assert flipped is not None, "the gateway never turned NOT_SERVING"
        assert flipped - health.turned_at < FLIP_BOUND_S, f"NOT_SERVING {flipped - health.turned_at:.2f}s after"
        loop.run(health.set("", SERVING))
        assert first_time(lambda: gateway.status() == SERVING) is not None
        gateway.channel.close()
        loop.run(running.stop())
        loop.run(server.stop(0))
    finally:
        loop.close()
