"""What every specdec gRPC server shares: health (grpc.health.v1), reflection, message-size limits,
graceful shutdown on SIGINT / SIGTERM, and a log line saying where it listens."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20  # inline hidden states of a full batch fit; anything bigger is a bug
OVERALL = ""                   # the health service name that means "the whole server"


@dataclass
class RunningServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: list[str]

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_names + [OVERALL]:
            self.health.set(name, status)

    def stop(self, grace: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait()


def channel_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def start_server(add_servicers: Callable[[grpc.Server], None], service_names: list[str], host: str, port: int,
                 workers: int = 32) -> RunningServer:
    """Start a server that reports NOT_SERVING until the caller says otherwise."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=channel_options())
    add_servicers(server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use?)")
    server.start()
    running = RunningServer(server, health_servicer, bound, service_names)
    running.set_serving(False)
    return running


def wait_for_termination(running: RunningServer, name: str, on_stop: Callable[[], None] | None = None) -> None:
    """Block until SIGINT / SIGTERM, then drain in-flight calls and stop."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("%s: shutting down (draining in-flight calls)", name)
    running.stop()
    if on_stop:
        on_stop()
    log.info("%s: stopped", name)
