"""What every specdec gRPC server shares: health (grpc.health.v1), reflection, message-size limits, a warning
when a port is exposed beyond this host, graceful shutdown on SIGINT / SIGTERM, and a log line saying where it
listens. The gateway and the verifier run on grpc.aio (``start_aio_server``): one event loop serves any number
of streams, so health checks and Info answer under any load. The drafter keeps the threaded server
(``start_server``): it serves one verifier stream at a time.

Message-size limits (what a peer may send us; bigger messages get RESOURCE_EXHAUSTED from gRPC itself):
``PUBLIC_MAX_REQUEST_BYTES`` on the gateway (a prompt of the largest context fits many times over),
``VERIFIER_MAX_REQUEST_BYTES`` on the verifier (requests from the gateway), ``MAX_MESSAGE_BYTES`` on the
drafter link (inline hidden states of a full batch).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20          # drafter link: inline hidden states of a full batch fit
VERIFIER_MAX_REQUEST_BYTES = 16 << 20  # gateway -> verifier: token ids of any context we serve
PUBLIC_MAX_REQUEST_BYTES = 4 << 20     # client -> gateway (--max-request-bytes)
OVERALL = ""                           # the health service name that means "the whole server"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@dataclass
class RunningServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: list[str]
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # run once, after the server has stopped

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_names + [OVERALL]:
            self.health.set(name, status)

    def stop(self, grace: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()
        while self.on_stop:
            self.on_stop.pop(0)()


@dataclass
class AioServer:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int
    service_names: list[str]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_names + [OVERALL]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def channel_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Size limits, and a reconnect backoff short enough that a restarted peer is found within seconds."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes),
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000)]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(name: str, host: str, secured: bool) -> None:
    if not is_loopback(host) and not secured:
        log.warning("%s listens on %s without TLS or authentication: anyone who can reach this address can use it "
                    "(see SECURITY.md)", name, host)


def _add_health_and_reflection(server, health_servicer, service_names: list[str]) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(service_names + [HEALTH_SERVICE, reflection.SERVICE_NAME], server)


def _bind(server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address} (in use?): {e}") from e
    if bound == 0:
        raise OSError(f"cannot listen on {address} (in use?)")
    return bound


def start_server(add_servicers: Callable[[grpc.Server], None], service_names: list[str], host: str, port: int,
                 workers: int = 32) -> RunningServer:
    """A threaded server that reports NOT_SERVING until the caller says otherwise (the drafter's)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=channel_options())
    add_servicers(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    _add_health_and_reflection(server, health_servicer, service_names)
    bound = _bind(server, f"{host}:{port}", None)
    warn_if_exposed(service_names[0] if service_names else "server", host, secured=False)
    server.start()
    running = RunningServer(server, health_servicer, bound, service_names)
    running.set_serving(False)
    return running


async def start_aio_server(add_servicers: Callable[[grpc.aio.Server], None], service_names: list[str], host: str,
                           port: int, *, max_request_bytes: int, credentials: grpc.ServerCredentials | None = None,
                           interceptors: tuple = ()) -> AioServer:
    """A grpc.aio server (call from a running event loop) that reports NOT_SERVING until told otherwise."""
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", max_request_bytes),
                                      ("grpc.max_send_message_length", max_request_bytes)])
    add_servicers(server)
    health_servicer = health_aio.HealthServicer()
    _add_health_and_reflection(server, health_servicer, service_names)
    bound = _bind(server, f"{host}:{port}", credentials)
    await server.start()
    running = AioServer(server, health_servicer, bound, service_names)
    await running.set_serving(False)
    return running


async def until_signal(name: str) -> None:
    """Return on SIGINT / SIGTERM (handled in the event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s: shutting down (draining in-flight calls)", name)


def wait_for_termination(running: RunningServer, name: str, on_stop: Callable[[], None] | None = None) -> None:
    """Block until SIGINT / SIGTERM, then drain in-flight calls and stop (threaded servers)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("%s: shutting down (draining in-flight calls)", name)
    running.stop()
    if on_stop:
        on_stop()
    log.info("%s: stopped", name)
