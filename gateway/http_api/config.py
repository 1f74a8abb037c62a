"""What the gateway's HTTP API listens on and checks (importable without FastAPI / uvicorn), and its connection
bounds: uvicorn alone puts no deadline on a request's headers, so 200 connections sending a header line every few
seconds (slowloris) stayed open for good."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HttpConfig:
    port: int                              # 0: any free port
    host: str = "127.0.0.1"
    api_key: str | None = None             # set: /v1 needs `Authorization: Bearer <key>`
    max_request_bytes: int = 4 << 20
    tls_cert_file: str | None = None       # PEM chain and key: serve HTTPS
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: require client certificates signed by it
    grace_s: float = 5.0
    header_timeout_s: float = 10.0         # a request's line and headers must arrive within this (slowloris)
    keep_alive_timeout_s: float = 5.0      # an idle kept-alive connection is closed after this
    max_connections: int = 1024            # open connections; one more is answered 503 and closed at once

    @property
    def secured(self) -> bool:
        """HTTPS with an API key or client certificates: fit to listen beyond this host."""
        return self.tls_cert_file is not None and bool(self.api_key or self.tls_client_ca_file)
