"""The verifier's drafter over the drafter link (drafter_link.py holds the connection and its lifecycle):
RemoteDrafter sends each step on the link's current connection and reads the drafter's answer.

Failures never fail a request: while the drafter is unreachable, refused, slow or broken, propose() returns
no drafts (the engine decodes with k = 0) while the link reconnects in the background.
A new connection holds no context: sequences it has not seen from position 0 come back in
DraftOutput.missing, and the engine re-sends (or recomputes) them.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec.drafting import DeviceDrafts, DeviceDraftStep, DraftBatch, DraftInput, DraftOutput, ModelFacts
from specdec.rpc.sampling_codec import grammar_to_proto
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.step_trace import OFF, StepTrace
from specdec.transport import tensor_bytes

from .device_step_link import DeviceSteps
from .drafter_link import DrafterLink, DrafterLinkConfig, LinkConnection
from .link_messages import link_message, prefix_messages

log = logging.getLogger(__name__)


@dataclass
class StepBook:
    """What a link's synchronous and device steps share: the step counter (the drafter refuses a replay), the
    sequences this connection holds from position 0, and the releases waiting to travel with the next step."""
    step: int = 0
    known: set[int] = field(default_factory=set)
    to_release: list[int] = field(default_factory=list)

    def next_step(self) -> tuple[int, list[int]]:
        """The next step's number and the seq ids it releases (they travel with it: no extra round trip)."""
        self.step += 1
        release, self.to_release = self.to_release, []
        return self.step, release

    def lost(self, missing_seq_ids) -> list[int]:
        """The drafter says it lacks these: those it was known to hold are no longer."""
        lost = [i for i in missing_seq_ids if i in self.known]
        self.known.difference_update(lost)
        return lost

    def forget(self) -> None:
        """A new connection: its drafter holds no sequence, and nothing waits to be released."""
        self.to_release.clear()
        self.known.clear()


class RemoteDrafter:
    """A Drafter (AnswersLater, DraftsOnDevice) whose drafter is a drafter service, reached through a DrafterLink;
    what the link's handshake settled (kind, needs_hidden, max_drafts, facts, transport_name) reads through."""

    def __init__(self, config: DrafterLinkConfig, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, max_rows: int, shared_weights: dict[str, torch.Tensor], model_type: str,
                 vocab_fingerprint: str = "", trace: StepTrace = OFF, max_seqs: int = 64):
        """max_rows: the most rows of one step (hidden states); max_seqs: the most sequences of one step."""
        self.config, self.trace = config, trace
        target = ModelFacts(hidden_size, vocab_size, tensor_bytes.DTYPE_NAMES[dtype], model_type, vocab_fingerprint)
        self.last_round_trip_ms, self.last_drafter_ms = 0.0, 0.0
        self.book = StepBook()
        self.link = DrafterLink(config, target, dtype, device, max_rows, max_seqs, shared_weights, self.book, trace)
        self.device_steps = DeviceSteps(self)   # steps drafted on the device (device_step_link.py)
        self.link.start()

    # ---- the link's state -----------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.link.connected

    @property
    def current(self) -> LinkConnection | None:
        """This step's connection (one reference per step: the link thread may replace it meanwhile)."""
        return self.link.connection

    @property
    def lock(self) -> threading.Lock:
        """Held while a reconnect replaces the connection and closes the old one's buffers."""
        return self.link.lock

    @property
    def kind(self) -> str:
        return self.link.kind

    @property
    def needs_hidden(self) -> bool:
        return self.link.needs_hidden

    @property
    def max_drafts(self) -> int:
        return self.link.max_drafts

    @property
    def facts(self) -> ModelFacts:
        return self.link.facts

    @property
    def transport_name(self) -> str:
        return self.link.transport_name

    def stream_ended(self, connection: LinkConnection, why: str) -> None:
        self.link.stream_ended(connection, why)

    def disconnect(self, connection: LinkConnection | None) -> None:
        self.link.disconnect(connection)

    # ---- DraftsOnDevice: the device steps' half, as a component ------------------------------------------------
    @property
    def drafts_on_device(self) -> bool:
        return self.device_steps.available

    def draft_on_device(self, step: DeviceDraftStep) -> DeviceDrafts:
        return self.device_steps.draft_later(step)()

    def draft_on_device_later(self, step: DeviceDraftStep) -> Callable[[], DeviceDrafts]:
        return self.device_steps.draft_later(step)

    # ---- Drafter protocol ------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> DraftOutput:
        return self.propose_later(batch)()

    def propose_later(self, batch: DraftBatch) -> Callable[[], DraftOutput]:
        """Send this step's message now; the returned call waits for the drafter's answer (AnswersLater)."""
        connection = self.current   # this step's connection, whatever the link thread does meanwhile
        if connection is None:
            out = DraftOutput.failed(len(batch.seqs), "the drafter is not connected")
            return lambda: out
        sent, missing, hidden = self._known_part(batch)
        if not sent:
            out = DraftOutput(drafts=[[] for _ in batch.seqs], missing=missing)
            return lambda: out
        step, release = self.book.next_step()
        message = pb.StepInput(step=step, release_seq_ids=release,
                               seqs=[seq_input_message(batch.seqs[i]) for i in sent],
                               prefixes=prefix_messages(batch.prefixes))
        self.trace.mark("link.message", step)
        if hidden is not None and connection.sender is not None:
            with self.lock:   # a reconnect closes the replaced connection's sender under this lock
                if connection is not self.current:
                    out = DraftOutput.failed(len(batch.seqs), "the drafter connection was replaced")
                    return lambda: out
                message.hidden.CopyFrom(link_message(pb.TensorRef, connection.sender.send(hidden)))
        start = time.perf_counter()
        self.trace.mark("link.sent", step)   # before the send: gRPC's thread may take it at once
        try:
            connection.stream.send(pb.DraftStepRequest(step=message))
        except OSError as e:   # the local lane's drafter is gone
            self.stream_ended(connection, f"the local lane: {e}")
            out = DraftOutput.failed(len(batch.seqs), "the drafter is not connected")
            return lambda: out
        return lambda: self._answer(connection, step, start, len(batch.seqs), sent, missing)

    def _answer(self, connection: LinkConnection, step: int, start: float, num_seqs: int, sent: list[int],
                missing: list[int]) -> DraftOutput:
        """The drafter's answer to step `step` (a failure if it is late, wrong or the stream ended)."""
        response = self.response(connection, step, start)
        if response is None or len(response.drafts) != len(sent):
            self.disconnect(connection)
            return DraftOutput.failed(num_seqs, f"drafter step {step} got no valid answer")
        drafts: list[list[int]] = [[] for _ in range(num_seqs)]
        for i, d in zip(sent, response.drafts):
            drafts[i] = list(d.token_ids)
        lost = self.book.lost(response.missing_seq_ids)
        return DraftOutput(drafts=drafts, missing=missing + lost, compute_seconds=response.drafter_ms / 1e3)

    def response(self, connection: LinkConnection, step: int, start: float) -> pb.DraftStepResponse | None:
        """The drafter's answer to step `step`, None if it is late, of another step or the stream ended."""
        left = start + self.config.step_timeout_s - time.perf_counter()
        response = connection.stream.receive(max(0.0, left))
        if response is None and time.perf_counter() - start >= self.config.step_timeout_s:
            log.warning("drafter step %d timed out after %.1fs", step, self.config.step_timeout_s)
        self.trace.mark("link.read", step)
        if response is None or response.step != step:
            return None
        self.link.answered(connection)   # (the first answer on it: a working connection)
        self.last_round_trip_ms = (time.perf_counter() - start) * 1e3  # sent → read, with what ran meanwhile
        self.last_drafter_ms = response.drafter_ms
        return response

    def _known_part(self, batch: DraftBatch) -> tuple[list[int], list[int], torch.Tensor | None]:
        """(indices of the sequences this connection can take, seq ids it lacks the context of, their hidden
        rows). A sequence is known once it was sent from position 0 on this connection."""
        known = self.book.known
        resumed = {p.seq_id for p in batch.prefixes if p.resumed}
        for s in batch.seqs:
            if s.start_pos == 0 or s.seq_id in resumed:   # (a resumed one: the drafter says if it lacks it)
                known.add(s.seq_id)
        sent = [i for i, s in enumerate(batch.seqs) if s.seq_id in known]
        missing = [s.seq_id for s in batch.seqs if s.seq_id not in known]
        hidden = batch.hidden
        if missing and hidden is not None:
            ends = torch.tensor([len(s.token_ids) - 1 for s in batch.seqs]).cumsum(0).tolist()
            rows = [r for i in sent for r in range(ends[i] - len(batch.seqs[i].token_ids) + 1, ends[i])]
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]  # [Σ n_i (sent), H]
        return sent, missing, hidden

    def release(self, seq_ids: list[int]) -> None:
        self.book.known.difference_update(seq_ids)
        self.book.to_release.extend(seq_ids)  # travels with the next step: no extra round trip

    def clear(self) -> None:
        self.book.to_release.clear()

    def close(self) -> None:
        self.link.close()


def seq_input_message(s: DraftInput) -> pb.SeqInput:
    message = pb.SeqInput(seq_id=s.seq_id, start_pos=s.start_pos, token_ids=s.token_ids, num_drafts=s.num_drafts)
    if s.grammar is not None:
        grammar_to_proto(s.grammar.spec, message.grammar)
        message.output_start = s.grammar.output_start
    return message
