"""uvicorn inside the gateway's event loop, serving the OpenAI-compatible app beside gRPC.

The socket is bound before the gRPC server starts, so by the time the gateway reports SERVING the HTTP port
accepts connections (and a port taken by someone else fails the start with a one-line error). The gateway
handles SIGINT / SIGTERM itself and stops uvicorn (``stop``), which finishes open responses for up to
``grace_s`` seconds. ``Guard`` checks, before any route runs, the API key (on /v1) and the body size.

Connections are bounded by ``BoundedH11Protocol`` (uvicorn's h11 protocol, pinned whatever else is installed): a
request's line and headers must arrive within ``header_timeout_s`` of the connection opening, or of the first
byte of the next request on a kept-alive one (uvicorn 0.54 has no such deadline: its keep-alive timer is disarmed
by any byte, and a fresh connection has none); an idle kept-alive connection is closed after
``keep_alive_timeout_s`` (uvicorn's own); beyond ``max_connections`` open ones a new connection is answered 503
and closed before anything of it is read.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import ssl

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..auth import ApiKey
from ..generator import Generator
from .config import HttpConfig
from . import errors
from .app import GENERATE_PATHS, build_app

log = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: 401 without the API key (paths under /v1), 413 for a body over the limit (by its
    Content-Length, or counted as it arrives when chunked)."""

    def __init__(self, app, api_key: ApiKey | None, max_bytes: int, on_refusal):
        self.app, self.api_key, self.max_bytes, self.on_refusal = app, api_key, max_bytes, on_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1/") and \
                not self.api_key.matches(headers.get(b"authorization")):
            return await self._refuse(scope, send, 401, "missing or wrong API key: send the header "
                                                        "'Authorization: Bearer <key>'")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self._refuse(scope, send, 413, self._too_large(length.decode("latin-1")))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLarge()
            return message
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, send, 413, self._too_large(f"more than {self.max_bytes}"))

    def _too_large(self, length: str) -> str:
        return (f"the request body is {length} bytes, the limit is {self.max_bytes} "
                "(--max-request-bytes)")

    async def _refuse(self, scope, send, status: int, message: str) -> None:
        if scope["method"] == "POST" and scope["path"] in GENERATE_PATHS:
            self.on_refusal(errors.CODE_NAME[status])
        data = json.dumps(errors.body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s")


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and a cap on open connections (class
    attributes, set per server by ``_bounded_protocol``)."""
    header_timeout_s: float = 10.0
    max_connections: int = 1024
    _busy: bytes = b""
    _head_timer: asyncio.TimerHandle | None = None
    _refused = False
    _warned_at = -math.inf                                   # when the limit was last logged (once a minute)

    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.max_connections:   # never counted: uvicorn does not see it
            self._refused = True
            transport.write(self._busy)
            transport.close()                                # after the write is flushed
            if self.loop.time() - BoundedH11Protocol._warned_at > 60:
                BoundedH11Protocol._warned_at = self.loop.time()
                log.warning("HTTP: %d connections open (--http-max-connections): refusing new ones with 503",
                            self.max_connections)
            return
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)   # cancels uvicorn's keep-alive timer: the next request has begun
            self._watch_head()

    def connection_lost(self, exc) -> None:
        if not self._refused:
            self._stop_head_timer()
            super().connection_lost(exc)

    def _watch_head(self) -> None:
        """The deadline runs while h11 waits for a request head (IDLE: none yet, or part of one) and from the
        moment it began to: a head trickling in a byte at a time does not push it back."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        elif not waiting:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("HTTP connection from %s closed: no complete request head within %.1fs",
                      "%s:%d" % self.client if self.client else "?", self.header_timeout_s)
            self.transport.close()


def _bounded_protocol(config: HttpConfig) -> type[BoundedH11Protocol]:
    data = json.dumps(errors.body(503, f"the server has {config.max_connections} connections open, its limit "
                                       "(--http-max-connections): retry shortly")).encode()
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {
        "header_timeout_s": config.header_timeout_s, "max_connections": config.max_connections,
        "_busy": BUSY % (len(data), data)})


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the gateway's event loop handles them and calls stop()."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, config: HttpConfig, generator: Generator):
        self.config = config
        api_key = ApiKey(config.api_key) if config.api_key else None
        app = Guard(build_app(generator), api_key, config.max_request_bytes,
                    lambda code: generator.metrics.refused("http", code))
        self.socket = _bind(config.host, config.port)
        self.port = self.socket.getsockname()[1]
        tls = dict(ssl_certfile=config.tls_cert_file, ssl_keyfile=config.tls_key_file,
                   ssl_ca_certs=config.tls_client_ca_file,
                   ssl_cert_reqs=ssl.CERT_REQUIRED if config.tls_client_ca_file else ssl.CERT_NONE)
        self._server = _EmbeddedServer(uvicorn.Config(
            app, http=_bounded_protocol(config), log_config=None, access_log=False, lifespan="off",
            server_header=False, timeout_keep_alive=config.keep_alive_timeout_s,
            timeout_graceful_shutdown=int(config.grace_s), **(tls if config.tls_cert_file else {})))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)   # our own log line says where it listens
        self._task = asyncio.create_task(self._server.serve(sockets=[self.socket]))
        self._task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self.socket.close()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    except OSError as e:
        raise OSError(f"cannot listen for HTTP on {host}:{port} (in use?): {e.strerror or e}") from e


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the HTTP server stopped", exc_info=task.exception())
