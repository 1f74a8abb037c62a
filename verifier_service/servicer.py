"""The Verifier gRPC service (grpc.aio) over the engine loop. Protobuf and status codes stop here.

Handlers never block the event loop: a Generate call hands its request to the engine thread and awaits its
outputs on an asyncio queue, so health, Info, Stats and Abort answer whatever the number of open streams.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from specdec.rpc.sampling_codec import params_from_proto
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.sampling_params import SamplingError

from .requests import RequestOutput
from .engine_loop import EngineLoop, EngineStopped, Failed, FailureKind, QueueFull

log = logging.getLogger(__name__)
STATUS = {FailureKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
          FailureKind.TOO_LONG: grpc.StatusCode.RESOURCE_EXHAUSTED,
          FailureKind.INTERNAL: grpc.StatusCode.INTERNAL}


def usage_of(o: RequestOutput, completion_tokens: int) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=o.num_prompt, completion_tokens=completion_tokens,
                             draft_tokens=o.stats.drafted, accepted_tokens=o.stats.accepted,
                             verify_steps=o.stats.verify_steps, queue_seconds=o.queue_seconds,
                             cached_tokens=o.cached_tokens)


def logprobs_to_proto(logprobs: list | None) -> list[gateway_pb2.TokenLogprob]:
    return [gateway_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                                     top_logprobs=lp.top_logprobs) for lp in logprobs or ()]


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, loop: EngineLoop, info: gateway_pb2.InfoResponse):
        self.loop, self.info = loop, info

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        try:
            params = params_from_proto(request.sampling).validate(self.info.vocab_size)
            if params.grammar is not None:   # compiled off the event loop (a large schema takes a while)
                await asyncio.to_thread(self.loop.check_grammar, params)
        except SamplingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        outputs: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        try:
            ticket = self.loop.submit(rid, list(request.prompt_token_ids), params,
                                      lambda item: event_loop.call_soon_threadsafe(outputs.put_nowait, item))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        try:
            completion = 0
            while True:
                item = await outputs.get()
                if isinstance(item, Failed):
                    await context.abort(STATUS[item.kind], item.message)
                completion += len(item.new_token_ids)
                yield verifier_pb2.TokenResponse(token_ids=item.new_token_ids, finish_reason=item.finish_reason or "",
                                                 usage=usage_of(item, completion),
                                                 forced_acceptance=item.forced_acceptance,
                                                 logprobs=logprobs_to_proto(item.logprobs))
                if item.finish_reason:
                    return
        finally:
            self.loop.cancel(ticket)  # the client went away (or the request ended: then a no-op)

    async def Abort(self, request, context):
        found = self.loop.is_running(request.request_id)
        self.loop.abort(request.request_id)
        return verifier_pb2.AbortResponse(found=found)

    async def Info(self, request, context):
        info = gateway_pb2.InfoResponse()
        info.CopyFrom(self.info)
        drafter = self.loop.engine.drafter
        connected = drafter is not None and getattr(drafter, "connected", True)   # a lost drafter is no drafter
        info.drafter_kind = getattr(drafter, "kind", "none") if connected else "none"
        info.num_draft_tokens = self.loop.engine.num_drafts
        return info

    async def Stats(self, request, context):
        engine = self.loop.engine
        blocks, s, drafter = engine.executor.blocks, engine.stats, engine.drafter
        prefix = engine.scheduler.prefix_stats
        return verifier_pb2.StatsResponse(
            free_kv_blocks=blocks.kv_blocks.num_free, total_kv_blocks=blocks.kv_blocks.size,
            free_gdn_slots=blocks.gdn_slots.num_free, total_gdn_slots=blocks.gdn_slots.size,
            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
            drafter_connected=bool(getattr(drafter, "connected", drafter is not None)),
            drafter_kind=getattr(drafter, "kind", "none") if drafter is not None else "none",
            drafter_fallbacks=engine.fallback_steps, mean_acceptance_length=s.mean_acceptance_length,
            verify_steps=s.verify_steps, draft_tokens=s.drafted, accepted_tokens=s.accepted,
            transport=getattr(drafter, "transport_name", "in-process" if drafter is not None else "none"),
            in_flight=self.loop.in_flight, engine_alive=self.loop.error is None,
            prefix_cache_queries=prefix.queried_tokens, prefix_cache_hits=prefix.hit_tokens,
            prefix_cache_checkpoints=len(blocks.checkpoints), prefix_cache_blocks=blocks.kv_blocks.num_registered)
