"""TLS and API-key settings of the public endpoint (the gateway) and of the clients that call it.

The server side: ``ServerTls`` (certificate chain + key, and a CA bundle when client certificates are
required) and an API key checked by ``gateway.auth``. The client side: ``ClientSecurity`` builds the channel
(TLS or plaintext) and the call metadata (``authorization: Bearer <key>``). Files are read once, in the CLI;
errors name the flag whose file is bad.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

API_KEY_HEADER = "authorization"       # gRPC metadata keys are lower case
API_KEY_SCHEME = "Bearer "             # what our clients send


def bearer_credentials(value: str | bytes | None) -> bytes | None:
    """The credentials of an authorization value in the Bearer scheme; None for another scheme or none at all.

    As RFC 7235 reads ``credentials = auth-scheme 1*SP token68``: the scheme name in any case (``bearer``,
    ``BEARER``), one or more spaces before the credentials, which are returned as they are (a key stays case
    sensitive: compare it in constant time)."""
    if value is None:
        return None
    data = value.encode() if isinstance(value, str) else bytes(value)
    scheme, space, credentials = data.partition(b" ")
    if not space or scheme.lower() != b"bearer":
        return None
    return credentials.lstrip(b" ")


def read_file(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from e
    if not data.strip():
        raise ValueError(f"{flag} {path}: the file is empty")
    return data


def read_api_key(path: str | None, value: str | None = None) -> str | None:
    """The API key from --api-key-file (first line), else `value` (e.g. $SPECDEC_API_KEY); None: no key."""
    data = read_file(path, "--api-key-file")
    key = data.decode("utf-8", errors="strict").strip().splitlines()[0].strip() if data else (value or "").strip()
    if key and (len(key) < 16 or not key.isprintable() or " " in key):
        raise ValueError("API key: use at least 16 printable characters without spaces")
    return key or None


@dataclass(frozen=True)
class ServerTls:
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None     # set: clients must present a certificate signed by this CA

    @staticmethod
    def from_files(cert: str | None, key: str | None, client_ca: str | None = None) -> "ServerTls | None":
        if not cert and not key:
            if client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (client certificates need TLS)")
            return None
        if not cert or not key:
            raise ValueError("--tls-cert and --tls-key go together: give both")
        return ServerTls(read_file(cert, "--tls-cert"), read_file(key, "--tls-key"),
                         read_file(client_ca, "--tls-client-ca"))

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientSecurity:
    tls: bool = False
    ca: bytes | None = None            # None with tls: the system's root certificates
    cert: bytes | None = None          # client certificate (when the server requires one)
    key: bytes | None = None
    api_key: str | None = None

    @staticmethod
    def from_files(tls: bool = False, ca: str | None = None, cert: str | None = None, key: str | None = None,
                   api_key: str | None = None) -> "ClientSecurity":
        if bool(cert) != bool(key):
            raise ValueError("--tls-cert and --tls-key go together: give both")
        return ClientSecurity(tls or bool(ca or cert), read_file(ca, "--tls-ca"), read_file(cert, "--tls-cert"),
                              read_file(key, "--tls-key"), api_key)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel(self, address: str, options: list | None = None) -> grpc.Channel:
        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((API_KEY_HEADER, API_KEY_SCHEME + self.api_key),) if self.api_key else ()
