"""Helpers of the gateway tests that need no model: a fake verifier (grpc.aio, real sockets) that records what the
gateway forwards, and an event loop in a thread for it and for in-process gateways, while the tests block on
sockets in the main thread."""
from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc

CONTEXT, VOCAB = 3000, 4096


class Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Info of a 3000-token context; Generate records the TokenRequest and answers one token."""

    def __init__(self):
        self.requests: list[verifier_pb2.TokenRequest] = []

    async def Info(self, request, context):
        return gateway_pb2.InfoResponse(model="fake", model_type="qwen3_5_text", max_context=CONTEXT,
                                        drafter_kind="none", vocab_size=VOCAB)

    async def Generate(self, request, context):
        self.requests.append(request)
        yield verifier_pb2.TokenResponse(token_ids=[65], finish_reason="length", usage=gateway_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=1))


async def serve(verifier: FakeVerifier, health: health_aio.HealthServicer | None = None) -> tuple[grpc.aio.Server, int]:
    """A server on 127.0.0.1 (any port) with `verifier` and `health` (SERVING); (server, port)."""
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
    health = health or health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
