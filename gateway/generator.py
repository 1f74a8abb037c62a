"""The one path of a Generate request, whichever API it came by (gRPC or HTTP). No torch here.

``prepare`` checks the request (the same validation for both APIs), renders ``messages`` with the model's chat
template (with the request's tools; tool_choice "required" or a named function becomes a grammar), tokenizes, settles max_tokens (``MaxTokens``: the server's default for a request that gives none, capped
by what the context leaves, and the most one may ask for), and checks the context; ``stream`` relays the
verifier's token stream as ``GenerateResponse`` messages (text deltas, stop strings applied, a last message with
finish_reason and usage; a chat reply's reasoning and tool calls parsed out of its text, chat_output.py).
Problems are raised as ``Refused`` carrying the gRPC status code; the HTTP face maps that code to its status.
Closing the ``stream`` generator early (the client went away) cancels the verifier call, which frees the
request's KV blocks and GDN slot at once. Every request is counted in GatewayMetrics once.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import grpc

from specdec.rpc.sampling_codec import params_to_proto
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.sampling_params import SamplingError, SamplingParams

from .chat_output import ChatOutput, ChatShape
from .chat_template import ChatTemplate, ChatTemplateError
from .completion import CompletionStream
from .metrics import GatewayMetrics, RequestRecord
from .reasoning import prompt_opens_reasoning
from .tokenizer import TextTokenizer
from .tool_calls import detect_format
from .tool_choice import NO_TOOLS, ToolPlan, ToolRequestError, plan_tools, template_tool_calls
from .validation import InvalidRequest, TooLong, check_context, validate_request

log = logging.getLogger(__name__)
NOT_READY = "the verifier has not answered yet (starting, or unreachable); retry shortly"
NO_TEMPLATE = ("messages: this model folder has no chat template (chat_template.jinja, or chat_template in "
               "tokenizer_config.json): send a prompt instead")
PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}
DEFAULT_MAX_TOKENS_DEFAULT = 1024


@dataclass(frozen=True)
class MaxTokens:
    """The server's bounds on completion length (``--max-tokens-default``, ``--max-tokens-limit``). Without them a
    chat request that gives no max_tokens would decode to the end of the context and hold its slot that long."""
    default: int = DEFAULT_MAX_TOKENS_DEFAULT  # a request that gives none (at most `limit` and what the context leaves)
    limit: int | None = None                   # the most a request may ask for (more: INVALID_ARGUMENT); None: none

    def __post_init__(self):
        for name, value in (("default", self.default), ("limit", self.limit)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"max tokens {name}: a positive integer is required, got {value!r}")

    def for_unset(self, api_default: int | None, context_left: int) -> int:
        """max_tokens of a request that gave none: the server's default, at most its limit, the API's own default
        (OpenAI completions: 16) and what the context leaves (at least 1: the context check then refuses it)."""
        caps = [c for c in (self.limit, api_default) if c is not None]
        return max(1, min(self.default, *caps, context_left))


class Refused(Exception):
    """A request the gateway will not (or can no longer) serve. `too_long`: prompt + max_tokens exceed the
    context (RESOURCE_EXHAUSTED on gRPC, which also means "queue full"; HTTP tells the two apart)."""

    def __init__(self, code: grpc.StatusCode, message: str, too_long: bool = False):
        super().__init__(message)
        self.code, self.message, self.too_long = code, message, too_long


@dataclass(frozen=True)
class PromptRequest:
    """What either API asks for: exactly one of prompt / prompt_token_ids / messages, and unvalidated sampling."""
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: list[dict] | None = None             # [{"role": str, "content": str, ...}], rendered by the template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat_template_kwargs: dict = field(default_factory=dict)
    max_tokens_set: bool = True                    # False: the client gave none; sampling.max_tokens is ignored and
    api_default_max_tokens: int | None = None      # ... MaxTokens.for_unset decides, with this API's own default
    tools: list[dict] | None = None                # OpenAI tools ({"type": "function", "function": {...}})
    tool_choice: str | dict | None = None          # "auto" (None) | "none" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None        # False: "required" makes exactly one call


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams                         # validated
    record: RequestRecord
    shape: ChatShape = field(default_factory=ChatShape)   # how the reply's text is parsed (a chat's)


class Generator:
    def __init__(self, verifier: verifier_pb2_grpc.VerifierStub, tokenizer: TextTokenizer | None,
                 chat_template: ChatTemplate | None = None, metrics: GatewayMetrics | None = None,
                 max_tokens: MaxTokens | None = None):
        self.verifier, self.tokenizer, self.chat_template = verifier, tokenizer, chat_template
        self.metrics = metrics or GatewayMetrics()
        self.max_tokens = max_tokens or MaxTokens()
        source = chat_template.source if chat_template is not None else ""
        self.tool_format = detect_format(source)          # the template's tool-call format, None: no tools
        self.thinks = "<think>" in source                 # the template has a thinking form
        self.info: gateway_pb2.InfoResponse | None = None  # the verifier's answer; None until it gave one
        self.serving = False                               # the verifier reports SERVING (the gateway's health)

    def set_info(self, info: gateway_pb2.InfoResponse) -> None:
        info.has_tokenizer = self.tokenizer is not None
        info.has_chat_template = self.tokenizer is not None and self.chat_template is not None
        self.info = info

    async def refresh_info(self) -> gateway_pb2.InfoResponse | None:
        """Live from the verifier (the drafter may have been swapped); the last answer if it is away."""
        try:
            self.set_info(await self.verifier.Info(gateway_pb2.InfoRequest(), timeout=2.0))
        except grpc.aio.AioRpcError:
            pass
        return self.info

    async def prepare(self, request: PromptRequest, api: str) -> Prepared:
        """Validate and tokenize; Refused (counted in the metrics) when the request cannot run."""
        record = self.metrics.start(api)
        try:
            ids, params, shape = await self._prepare(request)
        except Refused as e:
            record.failed(e.code.name)
            raise
        return Prepared(ids, params, record, shape)

    async def _prepare(self, request: PromptRequest) -> tuple[list[int], SamplingParams, ChatShape]:
        info = self.info
        if info is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        sampling = request.sampling if request.max_tokens_set else replace(request.sampling, max_tokens=1)
        try:
            params = validate_request(request.prompt, list(request.prompt_token_ids), sampling,
                                      self.tokenizer is not None, info.vocab_size, info.max_context,
                                      messages=request.messages, chat_template_kwargs=request.chat_template_kwargs,
                                      max_tokens_limit=self.max_tokens.limit)
            plan = self._plan_tools(request, params)
            ids, shape = list(request.prompt_token_ids), ChatShape()
            if not ids:  # text or messages: render and encode off the event loop (long prompts take a while)
                ids, shape = await asyncio.to_thread(self._encode, request, plan)
            if plan.parses:
                tool_grammar = plan.grammar(self.tool_format, shape.starts_in_reasoning)
                params = replace(params, grammar=tool_grammar) if tool_grammar is not None else params
            if not ids:
                raise InvalidRequest(f"{'messages' if request.messages else 'prompt'}: encodes to no tokens")
            if not request.max_tokens_set:
                params = replace(params, max_tokens=self.max_tokens.for_unset(request.api_default_max_tokens,
                                                                              info.max_context - len(ids)))
            check_context(len(ids), params.max_tokens, info.max_context)
        except TooLong as e:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), too_long=True) from None
        except (InvalidRequest, SamplingError, ToolRequestError) as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return ids, params, shape

    def _plan_tools(self, request: PromptRequest, params: SamplingParams) -> ToolPlan:
        plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
        if plan.tools and not request.messages:
            raise InvalidRequest("tools: tools go with messages (a chat), not with a prompt")
        if plan.parses and self.tool_format is None:
            raise InvalidRequest("tools: this model's chat template has no tool-call format (<tool_call>)")
        if plan.choice in ("required", "named") and params.grammar is not None:
            raise InvalidRequest("tool_choice: a required or named tool call is a grammar of its own; it cannot "
                                 "be combined with response_format")
        return plan

    def _encode(self, request: PromptRequest, plan: ToolPlan = NO_TOOLS) -> tuple[list[int], ChatShape]:
        if not request.messages:
            return self.tokenizer.encode(request.prompt), ChatShape()
        if self.chat_template is None:
            raise InvalidRequest(NO_TEMPLATE)
        for i, message in enumerate(request.messages):
            if not isinstance(message.get("role"), str) or not message["role"]:
                raise InvalidRequest(f"messages[{i}].role: a non-empty string is required")
        kwargs = dict(request.chat_template_kwargs) | ({"tools": plan.tools} if plan.tools else {})
        try:
            text = self.chat_template.render(template_tool_calls(request.messages), True, kwargs)
        except ChatTemplateError as e:
            raise InvalidRequest(str(e)) from None
        shape = ChatShape(self.thinks, self.thinks and prompt_opens_reasoning(text),
                          self.tool_format if plan.parses else None, plan.tools, plan.choice == "named")
        return self.tokenizer.encode(text, add_special_tokens=False), shape  # the template wrote the special tokens

    async def stream(self, request_id: str, prepared: Prepared) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The responses of one prepared request; Refused if the verifier fails it."""
        ids, params, record = prepared.prompt_ids, prepared.params, prepared.record
        forwarded = params_to_proto(replace(params, stop=()))  # stop strings are applied here, on text
        call = self.verifier.Generate(verifier_pb2.TokenRequest(
            request_id=f"{request_id}.{uuid.uuid4().hex[:12]}", prompt_token_ids=ids, sampling=forwarded))
        output = CompletionStream(self.tokenizer, ids, params.stop)
        chat = ChatOutput(prepared.shape) if not prepared.shape.plain else None
        usage = gateway_pb2.Usage(prompt_tokens=len(ids))
        try:
            async for reply in call:
                usage.CopyFrom(reply.usage)
                tokens, text, stopped = output.step(list(reply.token_ids), bool(reply.finish_reason))
                reason = "stop" if stopped else reply.finish_reason
                response = gateway_pb2.GenerateResponse(token_ids=tokens, text=text, finish_reason=reason,
                                                        request_id=request_id, logprobs=reply.logprobs[:len(tokens)])
                if chat is not None:
                    _put_chat_delta(response, chat.feed(text, bool(reason)))
                    if reason == "stop" and chat.num_calls and not prepared.shape.named_call:
                        response.finish_reason = reason = "tool_calls"   # as OpenAI ends a reply that calls
                record.sent(len(tokens))
                if reason:
                    usage.completion_tokens = output.completion_tokens
                    response.usage.CopyFrom(usage)
                    record.finished(reason, usage)
                yield response
                if reason:
                    return
            # The verifier ended the stream without a finish_reason (it should not): end it for the client.
            usage.completion_tokens = output.completion_tokens
            record.finished("abort", usage)
            last = gateway_pb2.GenerateResponse(finish_reason="abort", request_id=request_id, usage=usage)
            if chat is not None:   # what the parsers held back (a partial tag) is text the client gets
                _put_chat_delta(last, chat.feed("", True))
            yield last
        except grpc.aio.AioRpcError as e:
            refused = _verifier_refusal(request_id, e)
            record.failed(refused.code.name)
            raise refused from None
        except Exception:
            record.failed("INTERNAL")
            raise
        finally:
            call.cancel()                # the client went away or the stream is done: the verifier frees the slots
            record.failed("CANCELLED")   # a no-op when the request ended above


def _put_chat_delta(response: gateway_pb2.GenerateResponse, delta) -> None:
    response.text, response.reasoning_text = delta.text, delta.reasoning
    response.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)
                               for c in delta.tool_calls)


def _verifier_refusal(request_id: str, e: grpc.aio.AioRpcError) -> Refused:
    code = e.code()
    if code in PASSED_THROUGH:
        return Refused(code, e.details())
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Refused(grpc.StatusCode.UNAVAILABLE, f"verifier unavailable: {e.details()}")
    log.error("request %s: the verifier answered %s: %s", request_id, code.name, e.details())
    return Refused(grpc.StatusCode.INTERNAL, f"verifier error {code.name}: {e.details()}")
