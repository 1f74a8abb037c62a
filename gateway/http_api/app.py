"""The OpenAI-compatible routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` as server-sent
events ending in ``data: [DONE]``), GET /v1/models, GET /health.

Requests run through the gateway's ``Generator``, the path gRPC's Generate takes: the same validation, chat
template, tokenizer, stop strings and metrics (``responder.respond`` turns its messages into the HTTP response).
"""
from __future__ import annotations

import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from specdec.sampling_params import SamplingError, SamplingParams

from ..generator import NOT_READY, Generator, PromptRequest
from . import errors
from .chat import ChatFormat
from .completions import CompletionFormat
from .logprobs import TokenText
from .responder import ClientGone, respond
from .schemas import ChatRequest, CompletionRequest

log = logging.getLogger(__name__)
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # the OpenAI API's (and vLLM's) default for /v1/completions (within the
                                         # server's --max-tokens-default; chat has none of its own: the server's)
CLIENT_GONE = 499                        # nginx's "client closed request": nobody reads it


def build_app(generator: Generator) -> FastAPI:
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    token_text = TokenText(generator.tokenizer)
    started = int(time.time())

    def served_model(requested: str | None) -> str:
        info = generator.info
        if info is None:
            raise errors.HttpError(503, NOT_READY)
        if requested not in (None, info.model):
            raise errors.HttpError(404, f"model {requested!r} does not exist: this server serves {info.model!r}",
                                   "model", "model_not_found")
        return info.model

    @app.get("/health")
    async def health():
        if not generator.serving:
            return errors.response(errors.HttpError(503, "not serving: " + NOT_READY))
        return {"status": "serving"}

    @app.get("/v1/models")
    async def models():
        info = await generator.refresh_info()
        if info is None:
            raise errors.HttpError(503, NOT_READY)
        return {"object": "list", "data": [{"id": info.model, "object": "model", "created": started,
                                            "owned_by": "specdec", "max_model_len": info.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model = served_model(body.model)
        _refuse_unsupported(body)
        text, ids = body.prompt_parts()
        fields = _fields(body) | {"logprobs": body.logprobs, "max_tokens": body.max_tokens}
        prompt = PromptRequest(prompt=text, prompt_token_ids=ids, sampling=_sampling(fields),
                               max_tokens_set=body.max_tokens is not None,
                               api_default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
        rid = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(rid, model, token_text, body.logprobs is not None, _include_usage(body))
        return await respond(generator, request, prompt, fmt, rid, bool(body.stream),
                             COMPLETION_NAMES | _grammar_field(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        model = served_model(body.model)
        _refuse_unsupported(body)
        if not body.messages:
            raise errors.HttpError(400, "messages: at least one message is required", "messages")
        try:
            messages = body.template_messages()
        except ValueError as e:
            raise errors.HttpError(400, str(e), "messages") from None
        max_tokens = _default(body.max_completion_tokens, body.max_tokens)
        fields = _fields(body) | {"max_tokens": max_tokens,
                                           "logprobs": (body.top_logprobs or 0) if body.logprobs else None}
        prompt = PromptRequest(messages=messages, sampling=_sampling(fields), max_tokens_set=max_tokens is not None,
                               chat_template_kwargs=body.chat_template_kwargs or {}, tools=body.tools,
                               tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(rid, model, token_text, bool(body.logprobs), _include_usage(body))
        names = CHAT_NAMES | ({"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {})
        names |= _grammar_field(body)
        return await respond(generator, request, prompt, fmt, rid, bool(body.stream), names)

    _add_error_handlers(app, generator)
    return app


COMMON_NAMES = {n: n for n in ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                               "stop_token_ids", "ignore_eos", "speculation", "presence_penalty", "frequency_penalty",
                               "repetition_penalty", "stream", "stream_options", "n", "logit_bias", "sampling",
                               "response_format", "structured_outputs", "cache_salt")}
COMPLETION_NAMES = COMMON_NAMES | {"prompt": "prompt", "prompt_token_ids": "prompt", "logprobs": "logprobs",
                                   "echo": "echo", "suffix": "suffix", "best_of": "best_of"}
CHAT_NAMES = COMMON_NAMES | {"messages": "messages", "logprobs": "top_logprobs", "top_logprobs": "top_logprobs",
                             "max_completion_tokens": "max_completion_tokens", "tools": "tools",
                             "tool_choice": "tool_choice", "chat_template_kwargs": "chat_template_kwargs"}


def _default(value, default):
    return default if value is None else value


def _include_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _grammar_field(body) -> dict:
    """The field a grammar the verifier refuses came from: structured_outputs, the tools of a required or named
    tool_choice, else response_format."""
    if body.structured_outputs is not None:
        return {"grammar": "structured_outputs"}
    forced = getattr(body, "tools", None) and (getattr(body, "tool_choice", None) == "required"
                                               or isinstance(getattr(body, "tool_choice", None), dict))
    return {"grammar": "tools" if forced and body.response_format is None else "response_format"}


def _fields(body) -> dict:
    try:
        return body.sampling_fields()
    except ValueError as e:
        field = "structured_outputs" if str(e).startswith("structured_outputs") else "response_format"
        raise errors.HttpError(400, str(e), field) from None


def _refuse_unsupported(body) -> None:
    problem = body.unsupported()
    if problem is not None:
        raise errors.HttpError(400, f"{problem[0]}: {problem[1]}", problem[0])


def _sampling(fields: dict) -> SamplingParams:
    try:
        return SamplingParams.from_fields(fields)
    except SamplingError as e:
        raise errors.HttpError(400, str(e), errors.field_of(str(e), COMMON_NAMES)) from None


def _add_error_handlers(app: FastAPI, generator: Generator) -> None:
    def counted(request: Request, status: int) -> None:
        """Refusals before the generator saw the request (those it saw, it counted)."""
        if request.method == "POST" and request.url.path in GENERATE_PATHS:
            generator.metrics.refused("http", errors.CODE_NAME.get(status, "UNKNOWN"))

    @app.exception_handler(errors.HttpError)
    async def http_error(request: Request, e: errors.HttpError):
        counted(request, e.status)
        return errors.response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        counted(request, 400)
        first = e.errors()[0] if e.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return errors.response(errors.HttpError(400, "the request body is not valid JSON"))
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return errors.response(errors.HttpError(400, f"{where}: {first.get('msg', 'invalid')}", param))

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, e: HTTPException):
        counted(request, e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return errors.response(errors.HttpError(e.status_code, message))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone):
        log.info("%s: the client went away before its response; the request was cancelled", request.url.path)
        return Response(status_code=CLIENT_GONE)
