"""One verifier's step stream, whatever carries it (the gRPC Step stream, or the local socket of
local_lane.py): it registers the stream's buffers, checks each step and runs the drafter on it.

A malformed message (see step_check) refuses the stream before any of it is applied; a drafter that raises
ends it too. Either way the drafter's other sequences are untouched and the verifier reconnects."""
from __future__ import annotations

import logging
import time

import grpc
import torch

from specdec.drafting import DraftBatch, DraftInput, OutputGrammar
from specdec.rpc.sampling_codec import grammar_from_proto
from specdec.rpc.v1 import drafter_pb2 as pb

from .device_step import DeviceSteps, prefixes_of
from .step_check import step_problem
from .stream_buffers import StreamBuffers

log = logging.getLogger(__name__)


class StreamRefused(Exception):
    """The stream ends here, with this status (gRPC) or by closing the socket (the local lane)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class StepSession:
    def __init__(self, servicer):
        self.servicer = servicer   # the DrafterServicer: its holder, lock, counter and trace
        self.buffers, self.last_step = StreamBuffers(), 0
        self.device_steps = DeviceSteps(self.buffers)

    def handle(self, message: pb.DraftStepRequest) -> pb.DraftStepResponse | None:
        """The answer to one message of the stream (None for a setup); raises StreamRefused."""
        if message.HasField("setup"):
            self._setup(message.setup)
            return None
        step, s = message.step, self.servicer
        s.trace.mark("drafter.received", step.step)
        takes = s.holder.takes_device_steps and s.counter is None
        problem = step_problem(step, self.last_step, s.holder.info, self.buffers,
                               self.device_steps if takes else None)
        if problem:
            log.warning("refused step %d: %s", step.step, problem)
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"step {step.step}: {problem}")
        self.last_step = step.step
        try:
            response = self._run_step(step)
        except Exception as e:  # the drafter's bug: end this stream, keep serving
            log.exception("drafter %s failed at step %d", s.holder.config.kind, step.step)
            raise StreamRefused(grpc.StatusCode.INTERNAL, f"drafter failed at step {step.step}: {e}") from e
        s.trace.mark("drafter.answered", step.step)
        return response

    def _setup(self, setup: pb.Setup) -> None:
        with self.servicer.lock:
            try:
                self.buffers.register(setup)
            except (ValueError, OSError, RuntimeError) as e:
                log.warning("refused setup: %s", e)
                raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"setup: {e}") from e
            try:
                self._attach_weights()
            except torch.OutOfMemoryError as e:   # (a copy of the weights onto this GPU, say): refused, not a trace
                log.warning("refused setup: %s", e)
                raise StreamRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"setup: {e}") from e

    def _attach_weights(self) -> None:
        """A verifier's shared weights replace any earlier verifier's (which may be gone, its memory freed)."""
        holder, weights = self.servicer.holder, self.buffers.weights
        if not holder.wants_shared_weights:
            return
        if {"embed_tokens", "lm_head"} <= set(weights):   # mapped over CUDA IPC (copied if on another GPU)
            holder.attach(weights["embed_tokens"], weights["lm_head"])
        elif holder.drafter is None:
            holder.load_shared_from_folder()

    def _run_step(self, step: pb.StepInput) -> pb.DraftStepResponse:
        start, s = time.perf_counter(), self.servicer
        with s.lock:
            drafter = s.holder.drafter
            if drafter is None:
                s.holder.load_shared_from_folder()
                drafter = s.holder.drafter
            if step.release_seq_ids:
                drafter.release(list(step.release_seq_ids))
            if step.HasField("device"):
                return self._device_step(drafter, step, start)
            seqs = [draft_input_of(q) for q in step.seqs]
            hidden = self.buffers.read(step.hidden) if step.HasField("hidden") and drafter.needs_hidden else None
            if hidden is not None:
                hidden = hidden.to(s.holder.config.device, non_blocking=True)  # INLINE / SHM arrive on the host
            out = drafter.propose(DraftBatch(step.step, seqs, hidden, prefixes_of(step)))
            s.trace.mark("drafter.proposed", step.step)
            if s.counter is not None:
                s.counter.release(step.release_seq_ids)
                s.counter.add(seqs)
        drafts = [pb.SeqDrafts(token_ids=d) for d in out.drafts]
        return pb.DraftStepResponse(step=step.step, drafts=drafts, drafter_ms=(time.perf_counter() - start) * 1e3,
                                    missing_seq_ids=out.missing)

    def _device_step(self, drafter, step: pb.StepInput, start: float) -> pb.DraftStepResponse:
        """(under the lock) A step whose rows are in the registered buffers: queue the drafts, answer at once."""
        s = self.servicer
        out = self.device_steps.run(drafter, step, torch.device(s.holder.config.device))
        s.trace.mark("drafter.proposed", step.step)
        if out.failure:
            raise RuntimeError(out.failure)
        return pb.DraftStepResponse(step=step.step, draft_counts=out.counts, missing_seq_ids=out.missing,
                                    drafter_ms=(time.perf_counter() - start) * 1e3)


def draft_input_of(q: pb.SeqInput) -> DraftInput:
    """A sequence's input; a grammar without a kind is left out (drafts then only lose the grammar's guidance)."""
    grammar = None
    if q.HasField("grammar") and q.grammar.WhichOneof("kind") is not None:
        grammar = OutputGrammar(grammar_from_proto(q.grammar), q.output_start)
    return DraftInput(q.seq_id, q.start_pos, list(q.token_ids), q.num_drafts, grammar)
