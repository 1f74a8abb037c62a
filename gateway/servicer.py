"""The public Gateway service: text or token ids in, a stream of tokens and text out. No torch on this path."""
from __future__ import annotations

import logging
import uuid
from dataclasses import replace

import grpc

from specdec.rpc.sampling_codec import params_from_proto, params_to_proto
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.sampling_params import SamplingError, SamplingParams

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher
from .tokenizer import TextTokenizer
from .validation import InvalidRequest, TooLong, validate_request

log = logging.getLogger(__name__)
PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, verifier: verifier_pb2_grpc.VerifierStub, tokenizer: TextTokenizer | None,
                 info: gateway_pb2.InfoResponse):
        self.verifier, self.tokenizer, self.info = verifier, tokenizer, info

    def Info(self, request, context):
        """Live from the verifier (the drafter may have been swapped), the cached answer if it is away."""
        try:
            info = self.verifier.Info(gateway_pb2.InfoRequest(), timeout=5.0)
            info.has_tokenizer = self.tokenizer is not None
            self.info = info
        except grpc.RpcError:
            pass
        return self.info

    def _prompt_ids(self, request, context) -> tuple[list[int], SamplingParams]:
        try:
            params = validate_request(request.prompt, list(request.prompt_token_ids),
                                      params_from_proto(request.sampling), self.tokenizer is not None,
                                      self.info.vocab_size, self.info.max_context)
            ids = list(request.prompt_token_ids) or self.tokenizer.encode(request.prompt)
            if not ids:
                raise InvalidRequest("prompt: the text encodes to no tokens")
            if len(ids) + params.max_tokens > self.info.max_context:
                raise TooLong(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                              f"the maximum context of {self.info.max_context}")
        except TooLong as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (InvalidRequest, SamplingError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return ids, params

    def Generate(self, request, context):
        ids, params = self._prompt_ids(request, context)
        rid = request.request_id or uuid.uuid4().hex
        forwarded = params_to_proto(replace(params, stop=()))  # stop strings are applied here, on text
        call = self.verifier.Generate(verifier_pb2.TokenRequest(request_id=rid, prompt_token_ids=ids,
                                                                sampling=forwarded))
        context.add_callback(call.cancel)  # the client went away: the verifier aborts and frees the slots
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        stops = StopStringMatcher(list(params.stop)) if params.stop else None
        try:
            for reply in call:
                done = bool(reply.finish_reason)
                text = detokenizer.add(list(reply.token_ids)) + (detokenizer.flush() if done else "") \
                    if detokenizer else ""
                reason = reply.finish_reason
                if stops is not None:
                    text, hit = stops.feed(text)
                    if hit:
                        call.cancel()
                        done, reason = True, "stop"
                    elif done:
                        text += stops.flush()
                response = gateway_pb2.GenerateResponse(token_ids=reply.token_ids, text=text, finish_reason=reason,
                                                        request_id=rid, logprobs=reply.logprobs)
                if done:
                    response.usage.CopyFrom(reply.usage)
                yield response
                if done:
                    return
        except grpc.RpcError as e:
            if not context.is_active():
                return
            if e.code() in PASSED_THROUGH:
                context.abort(e.code(), e.details())
            if e.code() == grpc.StatusCode.CANCELLED and stops is not None:
                return
            context.abort(grpc.StatusCode.UNAVAILABLE, f"verifier unavailable: {e.details()}")
