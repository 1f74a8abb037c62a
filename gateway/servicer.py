"""The public Gateway service: text or token ids in, a stream of tokens and text out. No torch on this path."""
from __future__ import annotations

import logging
import uuid

import grpc

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

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

    def _prompt_ids(self, request, context) -> tuple[list[int], dict]:
        sampling = {f: getattr(request.sampling, f) for f in
                    ("max_tokens", "temperature", "top_p", "top_k", "ignore_eos")}
        sampling |= {"stop": list(request.sampling.stop), "stop_token_ids": list(request.sampling.stop_token_ids),
                     "seed": request.sampling.seed if request.sampling.HasField("seed") else None}
        try:
            sampling = validate_request(request.prompt, list(request.prompt_token_ids), sampling,
                                        self.tokenizer is not None, self.info.vocab_size, self.info.max_context)
            ids = list(request.prompt_token_ids) or self.tokenizer.encode(request.prompt)
            if not ids:
                raise InvalidRequest("prompt: the text encodes to no tokens")
            if len(ids) + sampling["max_tokens"] > self.info.max_context:
                raise TooLong(f"prompt ({len(ids)} tokens) + max_tokens ({sampling['max_tokens']}) exceeds "
                              f"the maximum context of {self.info.max_context}")
        except TooLong as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return ids, sampling

    def Generate(self, request, context):
        ids, sampling = self._prompt_ids(request, context)
        rid = request.request_id or uuid.uuid4().hex
        forwarded = gateway_pb2.SamplingParams(
            max_tokens=sampling["max_tokens"], temperature=sampling["temperature"], top_p=sampling["top_p"],
            top_k=sampling["top_k"], stop_token_ids=sampling["stop_token_ids"], ignore_eos=sampling["ignore_eos"])
        if sampling["seed"] is not None:
            forwarded.seed = sampling["seed"]
        call = self.verifier.Generate(verifier_pb2.TokenRequest(request_id=rid, prompt_token_ids=ids,
                                                                sampling=forwarded))
        context.add_callback(call.cancel)  # the client went away: the verifier aborts and frees the slots
        detokenizer = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        stops = StopStringMatcher(sampling["stop"]) if sampling["stop"] and self.tokenizer else None
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
                                                        request_id=rid)
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
