"""The Drafter gRPC service: handshake, the per-step bidirectional stream, release and cache clearing.
Protobuf stops here (and in step_session.py): the drafters see DraftBatch / DraftOutput.

A malformed message (see step_check) ends the stream with INVALID_ARGUMENT before any of it is applied; a
drafter that raises ends it with INTERNAL. Either way the drafter's other sequences are untouched and the
verifier reconnects. On the verifier's host the same stream may run over the local lane instead (local_lane.py,
offered in Info)."""
from __future__ import annotations

import logging
import threading

from specdec.drafting.token_counts import TokenCounter
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.step_thread import step_thread_on
from specdec.step_trace import OFF, StepTrace
from specdec.transport import cuda_ipc
from specdec.transport.host import host_id

from .factory import DrafterHolder
from .step_session import StepSession, StreamRefused

log = logging.getLogger(__name__)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, holder: DrafterHolder, gpu_uuid: str = "", counter: TokenCounter | None = None,
                 trace: StepTrace = OFF):
        self.holder, self.gpu_uuid, self.counter = holder, gpu_uuid, counter  # counter: --count-tokens
        self.trace = trace  # --trace-steps
        self.lock = threading.Lock()  # one step at a time: the drafter's caches are not thread-safe
        self.local_lane = ""          # the LocalLane's name, offered to a verifier on this host

    def Info(self, request, context):
        same_host = request.host_id == host_id()
        offered = list(request.transports) or [pb.INLINE]
        usable = [t for t in offered if t == pb.INLINE or (same_host and t == pb.SHM)
                  or (same_host and t == pb.CUDA_IPC and self.sees_gpu(request.gpu_uuid))]
        info = self.holder.info
        f = info.facts
        return pb.DrafterInfoResponse(
            kind=info.kind, max_drafts=info.max_drafts, hidden_size=f.hidden_size, dtype=f.dtype,
            vocab_size=f.vocab_size, model_type=f.model_type, vocab_fingerprint=f.vocab_fingerprint,
            needs_hidden_states=info.needs_hidden, needs_shared_weights=info.needs_shared_weights,
            transports=usable or [pb.INLINE], host_id=host_id(), gpu_uuid=self.gpu_uuid,
            local_lane=self.local_lane if same_host else "",
            # device steps keep the tokens on the device: not while counting the served tokens on the host
            device_steps=same_host and self.holder.takes_device_steps and self.counter is None,
            device_step_changes=True)   # (read by the stream's DeviceSteps, whatever the drafter)

    def sees_gpu(self, uuid: str) -> bool:
        """The verifier's GPU is this drafter's, or another this process can map (then copied: P2P)."""
        return bool(self.gpu_uuid) and (uuid == self.gpu_uuid or cuda_ipc.visible_device_index(uuid) is not None)

    def Step(self, request_iterator, context):
        session = StepSession(self)
        step_thread_on(self.holder.config.device)  # this handler thread runs every step
        log.info("verifier connected: step stream open")
        for message in request_iterator:
            try:
                response = session.handle(message)
            except StreamRefused as e:
                context.abort(e.code, e.details)
            if response is not None:
                yield response
        log.info("verifier disconnected: step stream closed after step %d", session.last_step)

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
