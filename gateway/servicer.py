"""The public Gateway service (grpc.aio): text, token ids or messages in, a stream of tokens and text out. No torch.

Each call is keyed on its own: the client's ``request_id`` names the call in responses and must be unique among
running calls (a duplicate is refused, the first runs on); the verifier sees a per-call id, so nothing one call
does can reach another. The request itself runs through ``Generator``, the path the HTTP API shares. Every
stream that ends normally ends with a message carrying a finish_reason and usage.
"""
from __future__ import annotations

import json
import uuid

import grpc

from specdec.rpc.sampling_codec import params_from_proto
from specdec.rpc.v1 import gateway_pb2
from specdec.sampling_params import SamplingError

from .generator import NOT_READY, Generator, PromptRequest, Refused
from .wire import MalformedRequest

MAX_REQUEST_ID = 128


class GatewayServicer:
    def __init__(self, generator: Generator):
        self.generator = generator
        self.running: set[str] = set()                     # request ids of the calls streaming now

    async def Info(self, request, context):
        info = await self.generator.refresh_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        return info

    async def Generate(self, request, context):
        if isinstance(request, MalformedRequest):
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        rid = request.request_id or uuid.uuid4().hex
        problem = _request_id_problem(rid) or (f"request_id {rid!r} is already in use by a running request: "
                                               "request ids must be unique" if rid in self.running else "")
        if problem:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.running.add(rid)  # before any await: a second call with this id now sees it
        try:
            try:
                prompt = prompt_request(request)
            except SamplingError as e:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                prepared = await self.generator.prepare(prompt, "grpc")
                async for response in self.generator.stream(rid, prepared):
                    yield response
            except Refused as e:
                await context.abort(e.code, e.message)
        finally:
            self.running.discard(rid)

    async def _refuse(self, context, code: grpc.StatusCode, message: str) -> None:
        self.generator.metrics.refused("grpc", code.name)
        await context.abort(code, message)


def prompt_request(request: gateway_pb2.GenerateRequest) -> PromptRequest:
    """SamplingError names a field that does not decode (a tool's parameters_json, chat_template_kwargs_json)."""
    messages = [_message(m) for m in request.messages]
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": _json_object(f"tools[{i}].parameters_json",
                                                                          t.parameters_json)}}
             for i, t in enumerate(request.tools)]
    choice = request.tool_choice or None
    if choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return PromptRequest(prompt=request.prompt, prompt_token_ids=tuple(request.prompt_token_ids),
                         messages=messages or None, sampling=params_from_proto(request.sampling),
                         max_tokens_set=request.sampling.HasField("max_tokens"),   # unset: the server's default
                         tools=tools or None, tool_choice=choice,
                         parallel_tool_calls=request.parallel_tool_calls if request.HasField("parallel_tool_calls")
                         else None,
                         chat_template_kwargs=_json_object("chat_template_kwargs_json",
                                                           request.chat_template_kwargs_json))


def _message(m: gateway_pb2.ChatMessage) -> dict:
    message = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        message["reasoning_content"] = m.reasoning_content
    return message


def _json_object(name: str, text: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SamplingError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise SamplingError(f"{name}: a JSON object is required")
    return value


def _request_id_problem(rid: str) -> str:
    if len(rid) > MAX_REQUEST_ID:
        return f"request_id is {len(rid)} characters long, the limit is {MAX_REQUEST_ID}"
    if not rid.isprintable():
        return "request_id must be printable text (no control characters)"
    return ""
