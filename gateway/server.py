"""`specdec gateway`: the public endpoint (grpc.aio). Loads the tokenizer (if the model folder has one), serves
specdec.rpc.v1.Gateway until SIGINT / SIGTERM, and follows the verifier: health is SERVING while the verifier
is, NOT_SERVING while it is away or failed (requests then get UNAVAILABLE); a restarted verifier is picked up,
its Info (context, vocabulary) re-read."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc import serving
from specdec.rpc.security import ServerTls
from specdec.rpc.v1 import gateway_pb2, verifier_pb2_grpc

from .auth import ApiKeyInterceptor
from .servicer import GatewayServicer
from .tokenizer import TextTokenizer
from .wire import SERVICE, add_gateway_to_server

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


async def follow_verifier(servicer: GatewayServicer, running: serving.AioServer, channel: grpc.aio.Channel,
                          address: str, poll_s: float) -> None:
    """Mirror the verifier's health into ours; refresh Info whenever it (re)appears."""
    health = health_pb2_grpc.HealthStub(channel)
    up: bool | None = None
    while True:
        try:
            ok = (await health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)).status == SERVING
            if ok and not up:
                servicer.set_info(await servicer.verifier.Info(gateway_pb2.InfoRequest(), timeout=5.0))
            problem = "" if ok else "it reports NOT_SERVING"
        except grpc.aio.AioRpcError as e:
            ok, problem = False, f"{e.code().name}: {e.details()}"
        if ok != up:
            info = servicer.info
            if ok:
                log.info("verifier at %s serving %s (%s, drafter %s, k=%d, context %d): gateway SERVING", address,
                         info.model, info.model_type, info.drafter_kind, info.num_draft_tokens, info.max_context)
            else:
                log.warning("verifier at %s unavailable (%s): gateway NOT_SERVING until it is back", address, problem)
            await running.set_serving(ok)
            up = ok
        await asyncio.sleep(poll_s)


async def start(config: GatewayConfig, tokenizer: TextTokenizer | None) -> tuple[serving.AioServer, asyncio.Task]:
    channel = grpc.aio.insecure_channel(config.verifier_address,
                                        options=serving.channel_options(serving.VERIFIER_MAX_REQUEST_BYTES))
    servicer = GatewayServicer(verifier_pb2_grpc.VerifierStub(channel), tokenizer)
    interceptors = (ApiKeyInterceptor(config.api_key, SERVICE),) if config.api_key else ()
    running = await serving.start_aio_server(
        lambda s: add_gateway_to_server(servicer, s), [SERVICE], config.host, config.port,
        max_request_bytes=config.max_request_bytes,
        credentials=config.tls.credentials() if config.tls else None, interceptors=interceptors)
    secured = config.tls is not None and bool(config.api_key or config.tls.client_ca)
    serving.warn_if_exposed("the gateway", config.host, secured)
    log.info("gateway listening on %s:%d (%s%s, tokenizer %s, requests up to %d bytes); waiting for the verifier "
             "at %s", config.host, running.port, "TLS" if config.tls else "plaintext",
             (", client certificates required" if config.tls and config.tls.client_ca else "")
             + (", API key required" if config.api_key else ""), "yes" if tokenizer else "no: token ids only",
             config.max_request_bytes, config.verifier_address)
    follower = asyncio.create_task(follow_verifier(servicer, running, channel, config.verifier_address,
                                                   config.verifier_poll_s))
    follower.add_done_callback(_log_failure)
    return running, follower


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the verifier follower stopped: health no longer tracks the verifier", exc_info=task.exception())


async def _serve(config: GatewayConfig, tokenizer: TextTokenizer | None) -> None:
    running, follower = await start(config, tokenizer)
    await serving.until_signal("gateway")
    follower.cancel()
    await running.stop()
    log.info("gateway: stopped")


def serve(config: GatewayConfig) -> None:
    tokenizer = TextTokenizer.from_folder(config.model_dir) if config.model_dir else None
    asyncio.run(_serve(config, tokenizer))
