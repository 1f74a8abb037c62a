"""The Drafter gRPC service: handshake, the per-step bidirectional stream, release and cache clearing.
Protobuf stops here: the drafters see DraftBatch / DraftOutput.

A malformed message (see step_check) ends the stream with INVALID_ARGUMENT before any of it is applied; a
drafter that raises ends it with INTERNAL. Either way the drafter's other sequences are untouched and the
verifier reconnects."""
from __future__ import annotations

import logging
import threading
import time

import grpc

from specdec.drafting import DraftBatch, DraftInput
from specdec.drafting.token_counts import TokenCounter
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.step_thread import serial_cpu_ops_in_this_thread
from specdec.step_trace import OFF, StepTrace
from specdec.transport.host import host_id

from .factory import DrafterHolder
from .step_check import step_problem
from .stream_buffers import StreamBuffers

log = logging.getLogger(__name__)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, holder: DrafterHolder, gpu_uuid: str = "", counter: TokenCounter | None = None,
                 trace: StepTrace = OFF):
        self.holder, self.gpu_uuid, self.counter = holder, gpu_uuid, counter  # counter: --count-tokens
        self.trace = trace  # --trace-steps
        self.lock = threading.Lock()  # one step at a time: the drafter's caches are not thread-safe

    def Info(self, request, context):
        same_host = request.host_id == host_id()
        offered = list(request.transports) or [pb.INLINE]
        usable = [t for t in offered if t == pb.INLINE or (same_host and t == pb.SHM)
                  or (same_host and t == pb.CUDA_IPC and self.gpu_uuid and request.gpu_uuid == self.gpu_uuid)]
        info = self.holder.info
        f = info.facts
        return pb.DrafterInfoResponse(
            kind=info.kind, max_drafts=info.max_drafts, hidden_size=f.hidden_size, dtype=f.dtype,
            vocab_size=f.vocab_size, model_type=f.model_type, vocab_fingerprint=f.vocab_fingerprint,
            needs_hidden_states=info.needs_hidden, needs_shared_weights=info.needs_shared_weights,
            transports=usable or [pb.INLINE], host_id=host_id(), gpu_uuid=self.gpu_uuid)

    def Step(self, request_iterator, context):
        buffers, last_step = StreamBuffers(), 0
        serial_cpu_ops_in_this_thread(self.holder.config.device)  # this handler thread runs every step
        log.info("verifier connected: step stream open")
        for message in request_iterator:
            if message.HasField("setup"):
                self._setup(message.setup, buffers, context)
                continue
            step = message.step
            self.trace.mark("drafter.received", step.step)
            problem = step_problem(step, last_step, self.holder.info, buffers)
            if problem:
                log.warning("refused step %d: %s", step.step, problem)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {step.step}: {problem}")
            last_step = step.step
            try:
                response = self._run_step(step, buffers)
            except Exception as e:  # the drafter's bug: end this stream, keep serving
                log.exception("drafter %s failed at step %d", self.holder.config.kind, step.step)
                context.abort(grpc.StatusCode.INTERNAL, f"drafter failed at step {step.step}: {e}")
            self.trace.mark("drafter.answered", step.step)
            yield response
        log.info("verifier disconnected: step stream closed after step %d", last_step)

    def _setup(self, setup: pb.Setup, buffers: StreamBuffers, context) -> None:
        with self.lock:
            try:
                buffers.register(setup)
            except (ValueError, OSError, RuntimeError) as e:
                log.warning("refused setup: %s", e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"setup: {e}")
            self._attach_weights(buffers)

    def _attach_weights(self, buffers: StreamBuffers) -> None:
        """A verifier's shared weights replace any earlier verifier's (which may be gone, its memory freed)."""
        if not self.holder.wants_shared_weights:
            return
        if {"embed_tokens", "lm_head"} <= set(buffers.weights):
            self.holder.attach(buffers.weights["embed_tokens"], buffers.weights["lm_head"])
            log.info("mapped the target's embed_tokens and lm_head over CUDA IPC (no second copy)")
        elif self.holder.drafter is None:
            self.holder.load_shared_from_folder()

    def _run_step(self, step: pb.StepInput, buffers: StreamBuffers) -> pb.DraftStepResponse:
        start = time.perf_counter()
        with self.lock:
            drafter = self.holder.drafter
            if drafter is None:
                self.holder.load_shared_from_folder()
                drafter = self.holder.drafter
            if step.release_seq_ids:
                drafter.release(list(step.release_seq_ids))
            seqs = [DraftInput(s.seq_id, s.start_pos, list(s.token_ids), s.num_drafts) for s in step.seqs]
            hidden = buffers.read(step.hidden) if step.HasField("hidden") and drafter.needs_hidden else None
            if hidden is not None:
                hidden = hidden.to(self.holder.config.device, non_blocking=True)  # INLINE / SHM arrive on the host
            out = drafter.propose(DraftBatch(step.step, seqs, hidden))
            self.trace.mark("drafter.proposed", step.step)
            if self.counter is not None:
                self.counter.release(step.release_seq_ids)
                self.counter.add(seqs)
        drafts = [pb.SeqDrafts(token_ids=d) for d in out.drafts]
        return pb.DraftStepResponse(step=step.step, drafts=drafts, drafter_ms=(time.perf_counter() - start) * 1e3,
                                    missing_seq_ids=out.missing)

    def Release(self, request, context):
        with self.lock:
            if self.holder.drafter is not None:
                self.holder.drafter.release(list(request.seq_ids))
            if self.counter is not None:
                self.counter.release(request.seq_ids)
        return pb.ReleaseResponse()

    def ClearCache(self, request, context):
        with self.lock:
            if self.holder.drafter is not None:
                self.holder.drafter.clear()
            if self.counter is not None:
                self.counter.clear()
        return pb.ClearCacheResponse()

    def close(self) -> None:
        """The server stopped: save the token counts (after any step still running)."""
        with self.lock:
            if self.counter is not None:
                self.counter.close()
                self.counter = None
            self.trace.close()   # a step still waiting for the lock counts nothing after the final save
