"""Errors of the HTTP API as OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.

Statuses: 400 bad input (the field named in ``param``; a prompt too long for the context is 400 with code
``context_length_exceeded``, as OpenAI answers), 401 missing or wrong API key, 404 unknown model or path, 413
request body over the size limit, 429 the verifier's queue is full, 503 the verifier is away or not ready, 500
our bug. Every status maps from the gRPC status code the same problem gets on the gRPC API.
"""
from __future__ import annotations

import re

import grpc
from fastapi.responses import JSONResponse

from ..generator import Refused

STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.NOT_FOUND: 404,
          grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500}
CODE_NAME = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
             413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
        413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}
# the field a message is about: its first word, e.g. "top_p must be in (0.0, 1.0]", "stop[1] must be ..." or
# "messages[0].tool_calls[1].name: ..." (the top-level name; the message has the path)
_LEADING_FIELD = re.compile(r"^([a-z_]+)(?:\[[^\]]*\]|\.[A-Za-z_][A-Za-z0-9_]*)*(?::|\s|$)")


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPE.get(status, "server_error"), "param": param, "code": code}}


def response(error: HttpError) -> JSONResponse:
    return JSONResponse(body(error.status, error.message, error.param, error.code), status_code=error.status)


def from_refused(e: Refused, names: dict[str, str]) -> HttpError:
    """The HTTP face of a refusal; `names` maps the gateway's field names to the request's (for `param`)."""
    if e.too_long:
        return HttpError(400, e.message, None, "context_length_exceeded")
    status = STATUS.get(e.code, 500)
    return HttpError(status, e.message, field_of(e.message, names) if status == 400 else None)


def field_of(message: str, names: dict[str, str]) -> str | None:
    """The request field a validation message starts with, by its name in the request; None if none."""
    match = _LEADING_FIELD.match(message)
    return names.get(match.group(1)) if match else None
