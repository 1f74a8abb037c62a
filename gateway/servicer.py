"""The public Gateway service (grpc.aio): text or token ids in, a stream of tokens and text out. No torch here.

Each call is keyed on its own: the client's ``request_id`` names the call in responses and must be unique among
running calls (a duplicate is refused, the first runs on); the verifier sees a per-call id, so nothing one call
does can reach another. Every stream that ends normally ends with a message carrying a finish_reason and usage.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace

import grpc

from specdec.rpc.sampling_codec import params_from_proto, params_to_proto
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.sampling_params import SamplingError, SamplingParams

from .completion import CompletionStream
from .tokenizer import TextTokenizer
from .validation import InvalidRequest, TooLong, validate_request
from .wire import MalformedRequest

log = logging.getLogger(__name__)
PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNAVAILABLE}
MAX_REQUEST_ID = 128
NOT_READY = "the verifier has not answered yet (starting, or unreachable); retry shortly"


class GatewayServicer:
    def __init__(self, verifier: verifier_pb2_grpc.VerifierStub, tokenizer: TextTokenizer | None):
        self.verifier, self.tokenizer = verifier, tokenizer
        self.info: gateway_pb2.InfoResponse | None = None  # the verifier's answer; None until it gave one
        self.running: set[str] = set()                     # request ids of the calls streaming now

    def set_info(self, info: gateway_pb2.InfoResponse) -> None:
        info.has_tokenizer = self.tokenizer is not None
        self.info = info

    async def Info(self, request, context):
        """Live from the verifier (the drafter may have been swapped), the last answer if it is away."""
        try:
            self.set_info(await self.verifier.Info(gateway_pb2.InfoRequest(), timeout=2.0))
        except grpc.aio.AioRpcError:
            if self.info is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        return self.info

    async def Generate(self, request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NOT_READY)
        rid = request.request_id or uuid.uuid4().hex
        problem = _request_id_problem(rid) or (f"request_id {rid!r} is already in use by a running request: "
                                               "request ids must be unique" if rid in self.running else "")
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.running.add(rid)  # before any await: a second call with this id now sees it
        try:
            ids, params = await self._validated(request, context)
            async for response in self._relay(rid, ids, params, context):
                yield response
        finally:
            self.running.discard(rid)

    async def _validated(self, request, context) -> tuple[list[int], SamplingParams]:
        info = self.info
        try:
            params = validate_request(request.prompt, list(request.prompt_token_ids),
                                      params_from_proto(request.sampling), self.tokenizer is not None,
                                      info.vocab_size, info.max_context)
            ids = list(request.prompt_token_ids)
            if not ids:  # a text prompt: encode off the event loop (long prompts take a while)
                ids = await asyncio.to_thread(self.tokenizer.encode, request.prompt)
            if not ids:
                raise InvalidRequest("prompt: the text encodes to no tokens")
            if len(ids) + params.max_tokens > info.max_context:
                raise TooLong(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                              f"the maximum context of {info.max_context}")
        except TooLong as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (InvalidRequest, SamplingError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return ids, params

    async def _relay(self, rid: str, ids: list[int], params: SamplingParams, context):
        forwarded = params_to_proto(replace(params, stop=()))  # stop strings are applied here, on text
        call = self.verifier.Generate(verifier_pb2.TokenRequest(
            request_id=f"{rid}.{uuid.uuid4().hex[:12]}", prompt_token_ids=ids, sampling=forwarded))
        output = CompletionStream(self.tokenizer, ids, params.stop)
        usage = gateway_pb2.Usage(prompt_tokens=len(ids))
        try:
            async for reply in call:
                usage.CopyFrom(reply.usage)
                tokens, text, stopped = output.step(list(reply.token_ids), bool(reply.finish_reason))
                reason = "stop" if stopped else reply.finish_reason
                response = gateway_pb2.GenerateResponse(token_ids=tokens, text=text, finish_reason=reason,
                                                        request_id=rid, logprobs=reply.logprobs[:len(tokens)])
                if reason:
                    usage.completion_tokens = output.completion_tokens
                    response.usage.CopyFrom(usage)
                yield response
                if reason:
                    return
            # The verifier ended the stream without a finish_reason (it should not): end it for the client.
            usage.completion_tokens = output.completion_tokens
            yield gateway_pb2.GenerateResponse(finish_reason="abort", request_id=rid, usage=usage)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in PASSED_THROUGH:
                await context.abort(code, e.details() if code != grpc.StatusCode.UNAVAILABLE
                                    else f"verifier unavailable: {e.details()}")
            if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"verifier unavailable: {e.details()}")
            log.error("request %s: the verifier answered %s: %s", rid, code.name, e.details())
            await context.abort(grpc.StatusCode.INTERNAL, f"verifier error {code.name}: {e.details()}")
        finally:
            call.cancel()  # the client went away or the stream is done: the verifier frees the slots


def _request_id_problem(rid: str) -> str:
    if len(rid) > MAX_REQUEST_ID:
        return f"request_id is {len(rid)} characters long, the limit is {MAX_REQUEST_ID}"
    if not rid.isprintable():
        return "request_id must be printable text (no control characters)"
    return ""
