"""The Drafter gRPC service: handshake, the per-step bidirectional stream, release and cache clearing.
Protobuf stops here: the drafters see DraftBatch / DraftOutput."""
from __future__ import annotations

import logging
import threading
import time

import grpc
import torch

from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.transport import cuda_ipc, tensor_bytes
from specdec.transport.host import host_id
from specdec.transport.shm_buffer import ShmBuffer

from .drafter import DraftBatch, DraftInput
from .factory import DrafterHolder

log = logging.getLogger(__name__)


class StreamBuffers:
    """Buffers one verifier registered on one Step stream, and how to read a TensorRef from them."""

    def __init__(self):
        self.shm: dict[str, ShmBuffer] = {}
        self.cuda: dict[str, torch.Tensor] = {}     # name -> uint8 view of the shared allocation
        self.events: dict[str, torch.cuda.Event] = {}
        self.weights: dict[str, torch.Tensor] = {}  # shared target weights (CUDA IPC)

    def register(self, setup: pb.Setup) -> None:
        for b in setup.buffers:
            if b.transport == pb.SHM:
                self.shm[b.name] = ShmBuffer.attach(b.shm_path, b.size_bytes)
            elif b.transport == pb.CUDA_IPC:
                device = cuda_ipc.find_device_by_uuid(b.gpu_uuid)
                export = cuda_ipc.CudaIpcExport(device, b.cuda_mem_handle, b.cuda_storage_size_bytes,
                                                b.cuda_storage_offset_bytes, b.cuda_ref_counter_handle,
                                                b.cuda_ref_counter_offset, b"")
                dtype = tensor_bytes.dtype_from_name(b.dtype)
                shape = tuple(b.shape) if b.shape else (b.size_bytes // torch.empty((), dtype=dtype).element_size(),)
                t = cuda_ipc.import_tensor(export, dtype, shape, device)
                if b.name == "hidden":
                    self.cuda[b.name] = t.view(torch.uint8).view(-1)
                    if b.cuda_event_handle:
                        self.events[b.name] = torch.cuda.Event.from_ipc_handle(device, b.cuda_event_handle)
                else:
                    self.weights[b.name] = t
            else:
                raise ValueError(f"buffer {b.name!r}: transport {b.transport} cannot be registered")

    def read(self, ref: pb.TensorRef) -> torch.Tensor:
        dtype, shape = tensor_bytes.dtype_from_name(ref.dtype), tuple(ref.shape)
        if ref.transport == pb.INLINE:
            return tensor_bytes.from_bytes(ref.data, dtype, shape)
        if ref.transport == pb.SHM:
            return self.shm[ref.buffer].view(ref.offset_bytes, dtype, shape)
        if ref.transport == pb.CUDA_IPC:
            if ref.buffer in self.events:
                torch.cuda.current_stream().wait_event(self.events[ref.buffer])
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            return self.cuda[ref.buffer][ref.offset_bytes:ref.offset_bytes + n].view(dtype).view(shape)
        raise ValueError(f"tensor transport {ref.transport} is not supported")


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, holder: DrafterHolder, gpu_uuid: str = ""):
        self.holder, self.gpu_uuid = holder, gpu_uuid
        self.lock = threading.Lock()  # one step at a time: the drafter's caches are not thread-safe

    def Info(self, request, context):
        same_host = request.host_id == host_id()
        offered = list(request.transports) or [pb.INLINE]
        usable = [t for t in offered if t == pb.INLINE or (same_host and t == pb.SHM)
                  or (same_host and t == pb.CUDA_IPC and self.gpu_uuid and request.gpu_uuid == self.gpu_uuid)]
        c = self.holder.config
        return pb.DrafterInfoResponse(
            kind=c.kind, max_drafts=min(c.max_drafts, request.max_drafts or c.max_drafts),
            hidden_size=request.hidden_size if self.holder.needs_hidden else 0, dtype=request.dtype,
            vocab_size=request.vocab_size, needs_hidden_states=self.holder.needs_hidden,
            needs_shared_weights=self.holder.wants_shared_weights, transports=usable or [pb.INLINE],
            host_id=host_id(), gpu_uuid=self.gpu_uuid)

    def Step(self, request_iterator, context):
        buffers, last_step = StreamBuffers(), 0
        log.info("verifier connected: step stream open")
        for message in request_iterator:
            if message.HasField("setup"):
                with self.lock:
                    buffers.register(message.setup)
                    self._attach_weights(buffers)
                continue
            step = message.step
            if step.step <= last_step:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {step.step} replayed (last was {last_step}): steps must increase")
            last_step = step.step
            yield self._run_step(step, buffers)
        log.info("verifier disconnected: step stream closed after step %d", last_step)

    def _attach_weights(self, buffers: StreamBuffers) -> None:
        if not self.holder.wants_shared_weights or self.holder.drafter is not None:
            return
        if {"embed_tokens", "lm_head"} <= set(buffers.weights):
            self.holder.attach(buffers.weights["embed_tokens"], buffers.weights["lm_head"])
            log.info("mapped the target's embed_tokens and lm_head over CUDA IPC (no second copy)")
        else:
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
        drafts = [pb.SeqDrafts(token_ids=d) for d in out.drafts]
        return pb.DraftStepResponse(step=step.step, drafts=drafts, drafter_ms=(time.perf_counter() - start) * 1e3)

    def Release(self, request, context):
        with self.lock:
            if self.holder.drafter is not None:
                self.holder.drafter.release(list(request.seq_ids))
        return pb.ReleaseResponse()

    def ClearCache(self, request, context):
        with self.lock:
            if self.holder.drafter is not None:
                self.holder.drafter.clear()
        return pb.ClearCacheResponse()
