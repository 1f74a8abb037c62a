"""API-key check on the public service: calls to specdec.rpc.v1.Gateway without ``authorization: Bearer <key>``
get UNAUTHENTICATED. Health and reflection stay open (probes and service discovery carry no key)."""
from __future__ import annotations

import hmac
import logging

import grpc

from specdec.rpc.security import API_KEY_HEADER, API_KEY_SCHEME

log = logging.getLogger(__name__)
REFUSAL = f"missing or wrong API key: send the metadata '{API_KEY_HEADER}: {API_KEY_SCHEME}<key>'"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str, protected_service: str):
        self._expected = (API_KEY_SCHEME + api_key).encode()
        self._prefix = f"/{protected_service}/"

    def authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == API_KEY_HEADER:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)  # constant time: no key guessing by timing
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        if self.authorized(details.invocation_metadata):
            return handler
        log.info("refused %s: missing or wrong API key", details.method)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED without running it."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=None, response_serializer=handler.response_serializer)  # never parsed
