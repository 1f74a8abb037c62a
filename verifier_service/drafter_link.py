"""The verifier's link to one drafter service: its connection's lifecycle (connect, handshake, open the step
stream, disconnect, reconnect). RemoteDrafter (drafter_client.py) drafts over the connection this link holds.

While the drafter is unreachable, refused, slow or broken the link holds no connection (the drafter proposes no
drafts meanwhile) and a background thread reconnects with exponential backoff. Handshake: each side reports its
own facts; a drafter that does not fit the target is refused (logged, with the reason) and the address is
retried, so a fitting drafter started there later is used without a restart. The steps travel over the
bidirectional gRPC Step stream, or the drafter's local lane on the same host (step_streams.py).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from specdec.drafting import DrafterInfo, ModelFacts, refusal_reason
from specdec.rpc.serving import channel_options
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.step_trace import StepTrace
from specdec.transport.host import host_id

from .device_exchange import DeviceExchange
from .hidden_sender import HiddenSender, offered_transports
from .link_messages import TRANSPORTS, link_message
from .step_streams import GrpcStepStream, LocalStepStream

if TYPE_CHECKING:
    from .drafter_client import StepBook

log = logging.getLogger(__name__)


class Refused(RuntimeError):
    """The drafter answered the handshake but does not fit the target."""


def drafter_info(response: pb.DrafterInfoResponse) -> DrafterInfo:
    facts = ModelFacts(response.hidden_size, response.vocab_size, response.dtype, response.model_type,
                       response.vocab_fingerprint)
    return DrafterInfo(response.kind, response.max_drafts, response.needs_hidden_states, facts,
                       response.needs_shared_weights)


@dataclass(frozen=True)
class LinkConnection:
    """One stream to the drafter. The engine thread takes the link's connection once per step (one reference: it
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


@dataclass(frozen=True)
class DrafterLinkConfig:
    address: str
    max_drafts: int
    transport: str = "auto"        # auto | cuda_ipc | shm | inline
    step_timeout_s: float = 10.0   # a step answered later than this counts as a failure
    max_backoff_s: float = 8.0
    step_channel: str = "auto"     # auto: the drafter's local lane when it offers one (same host) | grpc


class DrafterLink:
    """The connection to the drafter at config.address, and what its handshake settled (kind, needs_hidden,
    max_drafts, facts, transport_name). `connection` is None while there is none; `book` (the drafting's step
    book) is emptied whenever a new connection is published, since its drafter holds no context."""

    def __init__(self, config: DrafterLinkConfig, target: ModelFacts, dtype: torch.dtype, device: torch.device,
                 max_rows: int, max_seqs: int, shared_weights: dict[str, torch.Tensor], book: StepBook,
                 trace: StepTrace):
        self.config, self.target, self.dtype, self.device = config, target, dtype, device
        self.max_rows, self.max_seqs, self.shared_weights = max_rows, max_seqs, shared_weights
        self.book, self.trace = book, trace
        self.kind, self.needs_hidden, self.max_drafts, self.facts = "none", False, 0, ModelFacts()
        self.transport_name = "none"
        self.lock = threading.Lock()   # held while a reconnect replaces the connection, closing the old buffers
        self.connection: LinkConnection | None = None   # None: not connected (decode without drafts)
        self._channel: grpc.Channel | None = None     # the last connection's, closed when the next one opens
        self._sender: HiddenSender | None = None      # likewise (the drafter may still read its buffers)
        self._exchange: DeviceExchange | None = None  # likewise
        self._retired: list[DeviceExchange] = []      # replaced CUDA exchanges a late drafter may still write
        self._answered = False          # this connection answered a step: the next outage starts a fresh backoff
        self._last_problem = ""
        self._wake = threading.Event()
        self._closed = False

    def start(self) -> None:
        """Connect in the background, and reconnect whenever the connection is lost, until close()."""
        threading.Thread(target=self._connect_loop, name="drafter-link", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self.connection is not None

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
            connection = LinkConnection(self.open_stream(stub, response.local_lane, buffers), sender, exchange,
                                     exchange is not None and response.device_step_changes)
        except BaseException:   # no stream took these buffers: their files go now
            for held in (sender, exchange):
                if held is not None:
                    held.close()
            raise
        with self.lock:
            if self._sender is not None:
                self._sender.close()
            if self._exchange is not None:
                self._retire(self._exchange)
            if self._channel is not None:
                self._channel.close()
            self.book.forget()   # the new drafter holds no context: cleared before the engine sees it
            self._answered = False
            self.kind, self.needs_hidden, self.facts = info.kind, info.needs_hidden, info.facts
            self.max_drafts = info.max_drafts
            self.transport_name = transport if sender else "none"
            self._sender, self._exchange = sender, exchange
            self._channel, self.connection = channel, connection  # published last
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

    def open_stream(self, stub, local_lane: str, buffers: list) -> GrpcStepStream | LocalStepStream:
        """The drafter's local lane when it offers one and we may take it, else the gRPC Step stream."""
        setup = pb.DraftStepRequest(setup=pb.Setup(buffers=buffers))
        if local_lane and self.config.step_channel == "auto":
            try:
                return LocalStepStream(local_lane, setup, self.trace, self.config.step_timeout_s)
            except OSError as e:  # e.g. another network namespace (containers): gRPC carries the steps
                log.info("drafter's local lane not reachable from here (%s): steps go over gRPC", e)
        return GrpcStepStream(stub, setup, self.trace)

    def answered(self, connection: LinkConnection) -> None:
        """A step on `connection` got its answer. The first on the current connection: it works (the next problem
        is reported anew, the next outage starts a fresh backoff), and its drafter has mapped its files."""
        if not self._answered and connection is self.connection:  # (an answer of an older connection is not)
            self._answered, self._last_problem = True, ""
            connection.unlink_files()   # its drafter mapped them at the Setup, before this answer

    def stream_ended(self, connection: LinkConnection, why: str) -> None:
        if self.connection is connection:
            log.warning("drafter stream ended: %s", why)
        self.disconnect(connection)

    def disconnect(self, connection: LinkConnection | None) -> None:
        with self.lock:
            if connection is None or self.connection is not connection:
                return
            self.connection, self.max_drafts = None, 0
        connection.stream.close()
        connection.unlink_files()   # (a drafter still reading them has them mapped)
        log.warning("drafter %s lost: decoding without drafts until it is back", self.config.address)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self.disconnect(self.connection)
        if self._sender is not None:
            self._sender.close()
        if self._exchange is not None:
            self._exchange.close()


def _short(e: BaseException) -> str:
    return e.details() if isinstance(e, grpc.RpcError) and hasattr(e, "details") else str(e)
