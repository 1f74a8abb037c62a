"""The verifier's side of the drafter link: a Drafter over one long-lived step stream (the bidirectional gRPC
Step stream, or the drafter's local lane on the same host: step_streams.py).

Failures never fail a request: while the drafter is unreachable, refused, slow or broken, propose() returns
no drafts (the engine decodes with k = 0) and a background thread reconnects with exponential backoff.
Handshake: each side reports its own facts; a drafter that does not fit the target is refused (logged, with
the reason) and the address is retried, so a fitting drafter started there later is used without a restart.
A new connection holds no context: sequences it has not seen from position 0 come back in
DraftOutput.missing, and the engine re-sends (or recomputes) them.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from specdec.drafting import (DeviceDrafts, DeviceDraftStep, DraftBatch, DrafterInfo, DraftInput, DraftOutput,
                              ModelFacts, refusal_reason)
from specdec.rpc.sampling_codec import grammar_to_proto
from specdec.rpc.serving import channel_options
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.step_trace import OFF, StepTrace
from specdec.transport import tensor_bytes
from specdec.transport.host import host_id

from .device_exchange import DeviceExchange
from .device_step_link import DeviceSteps
from .hidden_sender import HiddenSender, offered_transports
from .link_messages import TRANSPORTS, link_message, prefix_messages
from .step_streams import GrpcStepStream, LocalStepStream

log = logging.getLogger(__name__)
STEP_CHANNELS = ("auto", "grpc")


class Refused(RuntimeError):
    """The drafter answered the handshake but does not fit the target."""


def drafter_info(response: pb.DrafterInfoResponse) -> DrafterInfo:
    facts = ModelFacts(response.hidden_size, response.vocab_size, response.dtype, response.model_type,
                       response.vocab_fingerprint)
    return DrafterInfo(response.kind, response.max_drafts, response.needs_hidden_states, facts,
                       response.needs_shared_weights)


@dataclass(frozen=True)
class _Connection:
    """One stream to the drafter. The engine thread takes `self._connection` once per step (one reference: it
    never sends on one stream and reads another's answers)."""
    stream: GrpcStepStream | LocalStepStream
    sender: HiddenSender | None    # the hidden-state buffers this connection registered
    exchange: DeviceExchange | None = None   # the device steps' buffers, when the drafter takes device steps
    changes_only: bool = False               # ... and reads them as changes (DeviceStep.changes_only)

    def unlink_files(self) -> None:
        """Remove the names of this connection's shared-memory files, once its drafter has mapped them (it
        answered a step, so it took the Setup before it) or will not (the connection ended). Both sides keep
        their mappings; nobody can open the files any more, and none outlives the verifier (shm_buffer.py)."""
        for held in (self.sender, self.exchange):
            if held is not None:
                held.unlink()


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


@dataclass(frozen=True)
class DrafterLinkConfig:
    address: str
    max_drafts: int
    transport: str = "auto"        # auto | cuda_ipc | shm | inline
    step_timeout_s: float = 10.0   # a step answered later than this counts as a failure
    max_backoff_s: float = 8.0
    step_channel: str = "auto"     # auto: the drafter's local lane when it offers one (same host) | grpc


class RemoteDrafter:
    def __init__(self, config: DrafterLinkConfig, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, max_rows: int, shared_weights: dict[str, torch.Tensor], model_type: str,
                 vocab_fingerprint: str = "", trace: StepTrace = OFF, max_seqs: int = 64):
        """max_rows: the most rows of one step (hidden states); max_seqs: the most sequences of one step."""
        self.config, self.device, self.max_rows, self.shared_weights = config, device, max_rows, shared_weights
        self.max_seqs = max_seqs
        self.trace = trace
        self.dtype = dtype
        self.target = ModelFacts(hidden_size, vocab_size, tensor_bytes.DTYPE_NAMES[dtype], model_type,
                                 vocab_fingerprint)
        self.kind, self.needs_hidden, self.max_drafts, self.facts = "none", False, 0, ModelFacts()
        self.transport_name, self.last_round_trip_ms, self.last_drafter_ms = "none", 0.0, 0.0
        self._lock = threading.Lock()
        self._connection: _Connection | None = None   # None: not connected (decode without drafts)
        self._channel: grpc.Channel | None = None     # the last connection's, closed when the next one opens
        self._sender: HiddenSender | None = None      # likewise (the drafter may still read its buffers)
        self._exchange: DeviceExchange | None = None  # likewise
        self._retired: list[DeviceExchange] = []      # replaced CUDA exchanges a late drafter may still write
        self.book = StepBook()
        self._answered = False          # this connection answered a step: the next outage starts a fresh backoff
        self._last_problem = ""
        self._wake = threading.Event()
        self._closed = False
        self.device_steps = DeviceSteps(self)   # steps drafted on the device (device_step_link.py)
        threading.Thread(target=self._connect_loop, name="drafter-link", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._connection is not None

    @property
    def current(self) -> _Connection | None:
        """This step's connection (one reference per step: the link thread may replace it meanwhile)."""
        return self._connection

    @property
    def lock(self) -> threading.Lock:
        """Held while a reconnect replaces the connection and closes the old one's buffers."""
        return self._lock

    # ---- DraftsOnDevice: the device steps' half, as a component ------------------------------------------------
    @property
    def drafts_on_device(self) -> bool:
        return self.device_steps.available

    def draft_on_device(self, step: DeviceDraftStep) -> DeviceDrafts:
        return self.device_steps.draft_later(step)()

    def draft_on_device_later(self, step: DeviceDraftStep) -> Callable[[], DeviceDrafts]:
        return self.device_steps.draft_later(step)

    # ---- connection ----------------------------------------------------------------------
    def _connect_loop(self) -> None:
        """Connect, stay while connected, reconnect. A drafter that is not reachable is retried at once (each try
        waits up to 2 s for the channel, which itself retries every 250 ms), so one that starts or restarts is
        found within about a second. One that answers and refuses, or accepts the handshake and then drops the
        stream, is retried ever later; that backoff starts over only after a connection that answered a step."""
        backoff = 0.25
        while not self._closed:
            try:
                self._connect()
            except Refused as e:
                self._report(f"drafter at {self.config.address} refused: {e}; decoding without drafts")
            except grpc.FutureTimeoutError:   # nothing answered for 2 s: try again at once
                self._report(f"drafter {self.config.address} not reachable", logging.DEBUG)
                continue
            except (grpc.RpcError, OSError, RuntimeError) as e:
                self._report(f"drafter {self.config.address} not reachable ({_short(e)})", logging.DEBUG)
            else:
                while self.connected and not self._closed:
                    self._wake.wait(1.0)
                    self._wake.clear()
                if self._answered:
                    backoff = 0.25
                    continue
                self._report(f"drafter {self.config.address} ended the stream before answering a step")
            time.sleep(backoff)
            backoff = min(backoff * 2, self.config.max_backoff_s)

    def _report(self, problem: str, level: int = logging.WARNING) -> None:
        """Log a connection problem once (then at DEBUG while it repeats)."""
        log.log(level if problem != self._last_problem else logging.DEBUG, "%s", problem)
        self._last_problem = problem

    def _connect(self) -> None:
        channel = grpc.insecure_channel(self.config.address, options=channel_options())
        try:
            self._handshake(channel)
        except BaseException:
            channel.close()
            raise

    def _ask_info(self, stub, offer: list[str]) -> pb.DrafterInfoResponse:
        uuid = ""
        if self.device.type == "cuda":
            from specdec.transport.cuda_ipc import gpu_uuid
            uuid = gpu_uuid(self.device)
        t = self.target
        return stub.Info(pb.DrafterInfoRequest(
            max_drafts=self.config.max_drafts, hidden_size=t.hidden_size, dtype=t.dtype, vocab_size=t.vocab_size,
            transports=[TRANSPORTS[x] for x in offer], host_id=host_id(), gpu_uuid=uuid, model_type=t.model_type,
            vocab_fingerprint=t.vocab_fingerprint), timeout=5.0)

    def _handshake(self, channel: grpc.Channel) -> None:
        grpc.channel_ready_future(channel).result(timeout=2.0)
        stub = drafter_pb2_grpc.DrafterStub(channel)
        offer = offered_transports(self.device, self.config.transport)
        response = self._ask_info(stub, offer)
        info = drafter_info(response)
        reason = refusal_reason(self.target, info)
        if reason:
            raise Refused(reason)
        transport = next((t for t in offer if TRANSPORTS[t] in response.transports), None)
        if transport is None:
            raise Refused(f"no common transport (offered {offer}, drafter accepts {list(response.transports)})")
        stub.ClearCache(pb.ClearCacheRequest(), timeout=5.0)
        sender = exchange = None
        try:
            sender = HiddenSender(transport, self.max_rows, self.target.hidden_size, self.dtype, self.device) \
                if info.needs_hidden else None
            shared = self.shared_weights if info.needs_shared_weights else {}
            buffers = [link_message(pb.SharedBuffer, b) for b in sender.setup(shared)] if sender else []
            if response.device_steps and sender is not None and transport in ("shm", "cuda_ipc"):
                exchange = DeviceExchange(transport, self.max_rows, self.max_seqs, info.max_drafts, self.device)
                buffers += [link_message(pb.SharedBuffer, b) for b in exchange.setup()]
            connection = _Connection(self._open_stream(stub, response.local_lane, buffers), sender, exchange,
                                     exchange is not None and response.device_step_changes)
        except BaseException:   # no stream took these buffers: their files go now
            for held in (sender, exchange):
                if held is not None:
                    held.close()
            raise
        with self._lock:
            if self._sender is not None:
                self._sender.close()
            if self._exchange is not None:
                self._retire(self._exchange)
            if self._channel is not None:
                self._channel.close()
            self.book.to_release.clear()   # the new drafter holds no context: cleared before the engine sees it
            self.book.known.clear()
            self._answered = False
            self.kind, self.needs_hidden, self.facts = info.kind, info.needs_hidden, info.facts
            self.max_drafts = info.max_drafts
            self.transport_name = transport if sender else "none"
            self._sender, self._exchange = sender, exchange
            self._channel, self._connection = channel, connection  # published last
        log.info("drafter %s connected at %s: k=%d, transport %s, hidden states %s, steps over %s%s", info.kind,
                 self.config.address, info.max_drafts, self.transport_name, info.needs_hidden,
                 connection.stream.channel, ", device steps" if exchange else "")
        # Read only once the connection is published: a stream that fails at once must find itself current.
        connection.stream.start(lambda why: self.stream_ended(connection, why))

    def _retire(self, exchange: DeviceExchange) -> None:
        """A replaced connection's exchange: shared-memory files are unlinked (a late drafter writes its own
        mapping); CUDA buffers are kept, since a drafter whose step timed out may still have a queued write
        into "drafts" that must not land in memory reused meanwhile (the last 8 reconnects' worth)."""
        exchange.close()
        if exchange.transport == "cuda_ipc":
            self._retired = (self._retired + [exchange])[-8:]

    def _open_stream(self, stub, local_lane: str, buffers: list) -> GrpcStepStream | LocalStepStream:
        """The drafter's local lane when it offers one and we may take it, else the gRPC Step stream."""
        setup = pb.DraftStepRequest(setup=pb.Setup(buffers=buffers))
        if local_lane and self.config.step_channel == "auto":
            try:
                return LocalStepStream(local_lane, setup, self.trace, self.config.step_timeout_s)
            except OSError as e:  # e.g. another network namespace (containers): gRPC carries the steps
                log.info("drafter's local lane not reachable from here (%s): steps go over gRPC", e)
        return GrpcStepStream(stub, setup, self.trace)

    def stream_ended(self, connection: _Connection, why: str) -> None:
        if self._connection is connection:
            log.warning("drafter stream ended: %s", why)
        self.disconnect(connection)

    def disconnect(self, connection: _Connection | None) -> None:
        with self._lock:
            if connection is None or self._connection is not connection:
                return
            self._connection, self.max_drafts = None, 0
        connection.stream.close()
        connection.unlink_files()   # (a drafter still reading them has them mapped)
        log.warning("drafter %s lost: decoding without drafts until it is back", self.config.address)
        self._wake.set()

    # ---- Drafter protocol ------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> DraftOutput:
        return self.propose_later(batch)()

    def propose_later(self, batch: DraftBatch) -> Callable[[], DraftOutput]:
        """Send this step's message now; the returned call waits for the drafter's answer (AnswersLater)."""
        connection = self._connection   # this step's connection, whatever the link thread does meanwhile
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
            with self._lock:   # a reconnect closes the replaced connection's sender under this lock
                if connection is not self._connection:
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

    def _answer(self, connection: _Connection, step: int, start: float, num_seqs: int, sent: list[int],
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

    def response(self, connection: _Connection, step: int, start: float) -> pb.DraftStepResponse | None:
        """The drafter's answer to step `step`, None if it is late, of another step or the stream ended."""
        left = start + self.config.step_timeout_s - time.perf_counter()
        response = connection.stream.receive(max(0.0, left))
        if response is None and time.perf_counter() - start >= self.config.step_timeout_s:
            log.warning("drafter step %d timed out after %.1fs", step, self.config.step_timeout_s)
        self.trace.mark("link.read", step)
        if response is None or response.step != step:
            return None
        if not self._answered and connection is self._connection:  # (an answer of an older connection is not)
            self._answered, self._last_problem = True, ""  # a working connection: report the next problem anew
            connection.unlink_files()   # its drafter mapped them at the Setup, before this answer
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
        self._closed = True
        self.disconnect(self._connection)
        if self._sender is not None:
            self._sender.close()
        if self._exchange is not None:
            self._exchange.close()



def _short(e: BaseException) -> str:
    return e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else str(e)


def seq_input_message(s: DraftInput) -> pb.SeqInput:
    message = pb.SeqInput(seq_id=s.seq_id, start_pos=s.start_pos, token_ids=s.token_ids, num_drafts=s.num_drafts)
    if s.grammar is not None:
        grammar_to_proto(s.grammar.spec, message.grammar)
        message.output_start = s.grammar.output_start
    return message
