"""`specdec gateway`: the public endpoint. Loads the tokenizer and chat template (if the model folder has them),
serves specdec.rpc.v1.Gateway (grpc.aio) and, with an HTTP port, the OpenAI-compatible API (uvicorn) in the same
event loop until SIGINT / SIGTERM, both through one Generator, and follows the verifier: health is SERVING while
the verifier is, NOT_SERVING while it is away or failed (requests then get UNAVAILABLE / 503), switched the moment
the verifier's own health changes or its process dies (a grpc.health.v1 Watch stream); a restarted verifier is
picked up, its Info (context, vocabulary) re-read. Prometheus metrics on --metrics-port."""
from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc import serving
from specdec.rpc.security import ServerTls
from specdec.rpc.v1 import gateway_pb2, verifier_pb2_grpc
from specdec.startup_heap import freeze_startup_heap

from .auth import ApiKey, ApiKeyInterceptor
from .chat_template import ChatTemplate
from .generator import Generator, MaxTokens
from .http_api.config import HttpConfig
from .metrics import GatewayMetrics
from .servicer import GatewayServicer
from .tokenizer import TextTokenizer
from .wire import SERVICE, add_gateway_to_server

if TYPE_CHECKING:
    from .http_api.server import HttpServer

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str | None                 # for its tokenizer files; None: token ids only
    verifier_address: str = "127.0.0.1:50052"
    host: str = "127.0.0.1"
    port: int = 50051
    tls: ServerTls | None = None
    api_key: str | None = None            # set: Gateway calls need `authorization: Bearer <key>`
    max_request_bytes: int = serving.PUBLIC_MAX_REQUEST_BYTES
    verifier_retry_s: float = 0.25        # while the verifier is away: how often to try its health stream again
    http: HttpConfig | None = None        # set: serve the OpenAI-compatible HTTP API too
    metrics_port: int | None = None       # set: Prometheus metrics on this port (0: any free one)
    max_tokens: MaxTokens = field(default_factory=MaxTokens)  # --max-tokens-default, --max-tokens-limit


async def follow_verifier(generator: Generator, running: serving.AioServer, channel: grpc.aio.Channel,
                          address: str, retry_s: float, probe_s: float = 1.0, probe_timeout_s: float = 2.0) -> None:
    """Mirror the verifier's health into ours at once; refresh Info whenever it (re)appears.

    While the verifier serves, a grpc.health.v1 ``Watch`` stream (no deadline) delivers its turn to NOT_SERVING as it
    happens and breaks the moment its process dies (the connection closes): no polling interval to wait out. Beside
    it a ``Check`` every `probe_s` (deadline `probe_timeout_s`) catches a verifier that hangs with its connection
    open, which no stream notices. While it is away or not serving, a new stream is opened every `retry_s` (its
    first message is the status; the channel's reconnect backoff, 250 ms to 2 s, paces connection attempts). The
    stream ends at NOT_SERVING so that a verifier shutting down (which says so first) has no call of ours to wait
    for."""
    health = health_pb2_grpc.HealthStub(channel)
    up: bool | None = None

    async def show(ok: bool, problem: str = "") -> None:
        nonlocal up
        if ok == up:
            return
        generator.serving = up = ok
        info = generator.info
        if ok:
            log.info("verifier at %s serving %s (%s, drafter %s, k=%d, context %d): gateway SERVING", address,
                     info.model, info.model_type, info.drafter_kind, info.num_draft_tokens, info.max_context)
        else:
            log.warning("verifier at %s unavailable (%s): gateway NOT_SERVING until it is back", address, problem)
        await running.set_serving(ok)

    async def watch(call) -> str:
        async for reply in call:
            if reply.status != SERVING:
                return "it reports NOT_SERVING"
            if not up:
                generator.set_info(await generator.verifier.Info(gateway_pb2.InfoRequest(), timeout=5.0))
                await show(True)
        return "its health stream ended"

    async def probe() -> None:
        while True:                                   # ends only by raising: the verifier hangs, or is gone
            await asyncio.sleep(probe_s)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=probe_timeout_s)

    while True:
        call = health.Watch(health_pb2.HealthCheckRequest())
        tasks = [asyncio.ensure_future(watch(call)), asyncio.ensure_future(probe())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:                                      # done, or the gateway stopping: end the other one and the call
            call.cancel()
            for task in tasks:
                task.cancel()
        try:
            problem = done.pop().result()
        except grpc.aio.AioRpcError as e:
            problem = f"{e.code().name}: {e.details()}"
        await show(False, problem)
        await asyncio.sleep(retry_s)


@dataclass
class RunningGateway:
    grpc_server: serving.AioServer
    follower: asyncio.Task
    http: HttpServer | None
    metrics_port: int | None

    async def stop(self) -> None:
        self.follower.cancel()
        await asyncio.gather(self.grpc_server.stop(), *([self.http.stop()] if self.http else []))


async def start(config: GatewayConfig, tokenizer: TextTokenizer | None,
                chat_template: ChatTemplate | None = None) -> RunningGateway:
    channel = grpc.aio.insecure_channel(config.verifier_address,
                                        options=serving.channel_options(serving.VERIFIER_MAX_REQUEST_BYTES))
    metrics = GatewayMetrics()
    generator = Generator(verifier_pb2_grpc.VerifierStub(channel), tokenizer, chat_template, metrics, config.max_tokens)
    http = None
    if config.http:  # FastAPI / uvicorn are imported only when the HTTP API is on
        from .http_api.server import HttpServer
        http = HttpServer(config.http, generator)  # bound first: ready before SERVING
    interceptors = (ApiKeyInterceptor(ApiKey(config.api_key), SERVICE, on_refusal=_counter(metrics)),) \
        if config.api_key else ()
    running = await serving.start_aio_server(
        lambda s: add_gateway_to_server(GatewayServicer(generator), s), [SERVICE], config.host, config.port,
        max_request_bytes=config.max_request_bytes,
        credentials=config.tls.credentials() if config.tls else None, interceptors=interceptors)
    secured = config.tls is not None and bool(config.api_key or config.tls.client_ca)
    serving.warn_if_exposed("the gateway", config.host, secured)
    if http is not None:
        http.start()
        serving.warn_if_exposed("the gateway's HTTP API", config.http.host, config.http.secured)
    metrics_port = metrics.serve(config.metrics_port, config.host) if config.metrics_port is not None else None
    log.info("gateway listening on %s:%d (%s%s, tokenizer %s, chat template %s, requests up to %d bytes)%s%s; "
             "waiting for the verifier at %s", config.host, running.port, "TLS" if config.tls else "plaintext",
             (", client certificates required" if config.tls and config.tls.client_ca else "")
             + (", API key required" if config.api_key else ""), "yes" if tokenizer else "no: token ids only",
             "yes" if chat_template else "no", config.max_request_bytes,
             f"; HTTP (OpenAI API) on {config.http.host}:{http.port}" if http else "",
             f"; metrics on :{metrics_port}/metrics" if metrics_port is not None else "", config.verifier_address)
    follower = asyncio.create_task(follow_verifier(generator, running, channel, config.verifier_address,
                                                   config.verifier_retry_s))
    follower.add_done_callback(_log_failure)
    return RunningGateway(running, follower, http, metrics_port)


def _counter(metrics: GatewayMetrics):
    def refused(method: str) -> None:
        if method.endswith("/Generate"):
            metrics.refused("grpc", "UNAUTHENTICATED")
    return refused


def _room_for_connections(connections: int, spare: int = 256) -> None:
    """Raise this process's open-file limit so `connections` HTTP connections fit beside gRPC's sockets and our
    files (a soft limit of 1024 is common); warn when the hard limit does not allow it. Without it the limit would
    never be reached: accept() would fail first, for gRPC too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + spare
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        if raised < wanted:
            log.warning("open files are limited to %d (ulimit -n): fewer than --http-max-connections %d + %d "
                        "for the rest; raise the hard limit", raised, connections, spare)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the verifier follower stopped: health no longer tracks the verifier", exc_info=task.exception())


async def _serve(config: GatewayConfig, tokenizer: TextTokenizer | None, chat_template: ChatTemplate | None) -> None:
    running = await start(config, tokenizer, chat_template)
    freeze_startup_heap("gateway")
    await serving.until_signal("gateway")
    await running.stop()
    log.info("gateway: stopped")


def serve(config: GatewayConfig) -> None:
    if config.http:
        _room_for_connections(config.http.max_connections)
    tokenizer = TextTokenizer.from_folder(config.model_dir) if config.model_dir else None
    chat_template = None
    if tokenizer is not None:
        chat_template = ChatTemplate.from_folder(config.model_dir, tokenizer.special_tokens_map)
    asyncio.run(_serve(config, tokenizer, chat_template))
