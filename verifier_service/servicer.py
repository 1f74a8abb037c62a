"""The Verifier gRPC service over the engine loop. Protobuf stops here."""
from __future__ import annotations

import logging
import uuid

import grpc

from specdec.rpc.sampling_codec import params_from_proto
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.sampling_params import SamplingError

from .engine import RequestOutput
from .engine_loop import EngineLoop, Failed

log = logging.getLogger(__name__)


def usage_of(o: RequestOutput, completion_tokens: int) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=o.num_prompt, completion_tokens=completion_tokens,
                             draft_tokens=o.stats.drafted, accepted_tokens=o.stats.accepted,
                             verify_steps=o.stats.verify_steps)


def logprobs_to_proto(logprobs: list | None) -> list[gateway_pb2.TokenLogprob]:
    return [gateway_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                                     top_logprobs=lp.top_logprobs) for lp in logprobs or ()]


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, loop: EngineLoop, info: gateway_pb2.InfoResponse):
        self.loop, self.info = loop, info

    def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        try:
            params = params_from_proto(request.sampling)
        except SamplingError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        outputs = self.loop.submit(rid, list(request.prompt_token_ids), params)
        context.add_callback(lambda: self.loop.abort(rid))  # client gone (or done: then a no-op)
        completion = 0
        while True:
            item = outputs.get()
            if item is None:
                return
            if isinstance(item, Failed):
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(item.error, OverflowError)
                        else grpc.StatusCode.INVALID_ARGUMENT if isinstance(item.error, ValueError)
                        else grpc.StatusCode.INTERNAL)
                context.abort(code, str(item.error))
            completion += len(item.new_token_ids)
            yield verifier_pb2.TokenResponse(token_ids=item.new_token_ids, finish_reason=item.finish_reason or "",
                                             usage=usage_of(item, completion),
                                             forced_acceptance=item.forced_acceptance,
                                             logprobs=logprobs_to_proto(item.logprobs))
            if item.finish_reason:
                return

    def Abort(self, request, context):
        found = request.request_id in self.loop.engine.by_request
        self.loop.abort(request.request_id)
        return verifier_pb2.AbortResponse(found=found)

    def Info(self, request, context):
        info = gateway_pb2.InfoResponse()
        info.CopyFrom(self.info)
        drafter = self.loop.engine.drafter
        connected = drafter is not None and getattr(drafter, "connected", True)   # a lost drafter is no drafter
        info.drafter_kind = getattr(drafter, "kind", "none") if connected else "none"
        info.num_draft_tokens = self.loop.engine.num_drafts
        return info

    def Stats(self, request, context):
        engine = self.loop.engine
        runner, s, drafter = engine.runner, engine.stats, engine.drafter
        return verifier_pb2.StatsResponse(
            free_kv_blocks=runner.blocks.num_free, total_kv_blocks=runner.blocks.size,
            free_gdn_slots=runner.gdn_slots.num_free, total_gdn_slots=runner.gdn_slots.size,
            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
            drafter_connected=bool(getattr(drafter, "connected", drafter is not None)),
            drafter_kind=getattr(drafter, "kind", "none") if drafter is not None else "none",
            drafter_fallbacks=engine.fallback_steps, mean_acceptance_length=s.mean_acceptance_length,
            verify_steps=s.verify_steps, draft_tokens=s.drafted, accepted_tokens=s.accepted,
            transport=getattr(drafter, "transport_name", "in-process" if drafter is not None else "none"))
