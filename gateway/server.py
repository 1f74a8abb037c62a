"""`specdec gateway`: the public endpoint. Loads the tokenizer and chat template (if the model folder has them),
serves specdec.rpc.v1.Gateway (grpc.aio) and, with an HTTP port, the OpenAI-compatible API (uvicorn) in the same
event loop until SIGINT / SIGTERM, both through one Generator, and follows the verifier: health is SERVING while
the verifier is, NOT_SERVING while it is away or failed (requests then get UNAVAILABLE / 503); a restarted
verifier is picked up, its Info (context, vocabulary) re-read. Prometheus metrics on --metrics-port."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc import serving
from specdec.rpc.security import ServerTls
from specdec.rpc.v1 import gateway_pb2, verifier_pb2_grpc
from specdec.startup_heap import freeze_startup_heap

from .auth import ApiKey, ApiKeyInterceptor
from .chat_template import ChatTemplate
from .generator import Generator
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
    verifier_poll_s: float = 1.0
    http: HttpConfig | None = None        # set: serve the OpenAI-compatible HTTP API too
    metrics_port: int | None = None       # set: Prometheus metrics on this port (0: any free one)


async def follow_verifier(generator: Generator, running: serving.AioServer, channel: grpc.aio.Channel,
                          address: str, poll_s: float) -> None:
    """Mirror the verifier's health into ours; refresh Info whenever it (re)appears."""
    health = health_pb2_grpc.HealthStub(channel)
    up: bool | None = None
    while True:
        try:
            ok = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)).status == SERVING
            if ok and not up:
                generator.set_info(await generator.verifier.Info(gateway_pb2.InfoRequest(), timeout=5.0))
            problem = "" if ok else "it reports NOT_SERVING"
        except grpc.aio.AioRpcError as e:
            ok, problem = False, f"{e.code().name}: {e.details()}"
        if ok != up:
            info = generator.info
            if ok:
                log.info("verifier at %s serving %s (%s, drafter %s, k=%d, context %d): gateway SERVING", address,
                         info.model, info.model_type, info.drafter_kind, info.num_draft_tokens, info.max_context)
            else:
                log.warning("verifier at %s unavailable (%s): gateway NOT_SERVING until it is back", address, problem)
            await running.set_serving(ok)
            generator.serving = up = ok
        await asyncio.sleep(poll_s)


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
    generator = Generator(verifier_pb2_grpc.VerifierStub(channel), tokenizer, chat_template, metrics)
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
                                                   config.verifier_poll_s))
    follower.add_done_callback(_log_failure)
    return RunningGateway(running, follower, http, metrics_port)


def _counter(metrics: GatewayMetrics):
    def refused(method: str) -> None:
        if method.endswith("/Generate"):
            metrics.refused("grpc", "UNAUTHENTICATED")
    return refused


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
    tokenizer = TextTokenizer.from_folder(config.model_dir) if config.model_dir else None
    chat_template = None
    if tokenizer is not None:
        chat_template = ChatTemplate.from_folder(config.model_dir, tokenizer.special_tokens_map)
    asyncio.run(_serve(config, tokenizer, chat_template))
