"""API-key check on the public APIs: gRPC calls to specdec.rpc.v1.Gateway, and HTTP requests under /v1, without
``authorization: Bearer <key>`` are refused (UNAUTHENTICATED / 401). The scheme name is case-insensitive and may be
followed by several spaces (RFC 7235); the key is compared exactly, in constant time. Health and reflection stay
open (probes and service discovery carry no key)."""
from __future__ import annotations

import hmac
import logging
from typing import Callable

import grpc

from specdec.rpc.security import API_KEY_HEADER, API_KEY_SCHEME, bearer_credentials

log = logging.getLogger(__name__)
REFUSAL = f"missing or wrong API key: send the metadata '{API_KEY_HEADER}: {API_KEY_SCHEME}<key>'"


class ApiKey:
    """The one comparison both APIs make."""

    def __init__(self, api_key: str):
        self._expected = api_key.encode()

    def matches(self, header_value: str | bytes | None) -> bool:
        """Is `header_value` (the authorization header or metadata) 'Bearer <the key>' (scheme in any case)?"""
        given = bearer_credentials(header_value)
        if given is None:
            return False
        return hmac.compare_digest(given, self._expected)  # constant time: no key guessing by timing


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: ApiKey, protected_service: str, on_refusal: Callable[[str], None] | None = None):
        self._key = api_key
        self._prefix = f"/{protected_service}/"
        self._on_refusal = on_refusal  # called with the method's full name

    def authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == API_KEY_HEADER:
                return self._key.matches(value)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        if self.authorized(details.invocation_metadata):
            return handler
        log.info("refused %s: missing or wrong API key", details.method)
        if self._on_refusal is not None:
            self._on_refusal(details.method)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without running it."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=None, response_serializer=handler.response_serializer)  # never parsed
