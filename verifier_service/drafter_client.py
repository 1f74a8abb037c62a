"""The verifier's side of the drafter link: a Drafter over one long-lived bidirectional gRPC stream.

Failures never fail a request: while the drafter is unreachable, slow or broken, propose() returns no drafts
(the engine decodes with k = 0) and a background thread reconnects with exponential backoff. Each successful
(re)connection is a new `generation`: the engine re-sends context where it can (see SpecEngine._draft).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from drafter_service.drafter import DraftBatch, DraftOutput
from specdec.rpc.serving import channel_options
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.transport import tensor_bytes
from specdec.transport.host import host_id

from .hidden_sender import HiddenSender, offered_transports

log = logging.getLogger(__name__)
_END = object()
TRANSPORTS = {"inline": pb.INLINE, "shm": pb.SHM, "cuda_ipc": pb.CUDA_IPC}


def _message(cls, fields: dict):
    """A drafter.proto message from HiddenSender's plain fields (transport names become the enum)."""
    return cls(**{k: TRANSPORTS[v] if k == "transport" else v for k, v in fields.items()})


@dataclass(frozen=True)
class DrafterLinkConfig:
    address: str
    max_drafts: int
    transport: str = "auto"        # auto | cuda_ipc | shm | inline
    step_timeout_s: float = 10.0   # a step answered later than this counts as a failure
    max_backoff_s: float = 8.0


class RemoteDrafter:
    def __init__(self, config: DrafterLinkConfig, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, max_rows: int, shared_weights: dict[str, torch.Tensor], model_type: str):
        self.config, self.hidden_size, self.vocab_size, self.dtype = config, hidden_size, vocab_size, dtype
        self.device, self.max_rows, self.shared_weights, self.model_type = device, max_rows, shared_weights, model_type
        self.kind, self.needs_hidden, self.max_drafts, self.generation = "none", False, 0, 0
        self.transport_name, self.fallbacks, self.last_round_trip_ms, self.last_drafter_ms = "none", 0, 0.0, 0.0
        self._lock = threading.Lock()
        self._requests: queue.Queue | None = None
        self._responses: queue.Queue = queue.Queue()
        self._call = None
        self._channel: grpc.Channel | None = None
        self._sender: HiddenSender | None = None
        self._pending_release: list[int] = []
        self._wake = threading.Event()
        self._closed = False
        self._step = 0
        threading.Thread(target=self._connect_loop, name="drafter-link", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._requests is not None

    # ---- connection ----------------------------------------------------------------------
    def _connect_loop(self) -> None:
        backoff = 0.25
        while not self._closed:
            if self.connected:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._connect()
                backoff = 0.25
            except (grpc.RpcError, grpc.FutureTimeoutError, OSError, RuntimeError) as e:
                log.debug("drafter %s not reachable (%s); retrying in %.2fs", self.config.address, e, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, self.config.max_backoff_s)

    def _connect(self) -> None:
        channel = grpc.insecure_channel(self.config.address, options=channel_options())
        try:
            self._handshake(channel)
        except BaseException:
            channel.close()
            raise

    def _handshake(self, channel: grpc.Channel) -> None:
        grpc.channel_ready_future(channel).result(timeout=2.0)
        stub = drafter_pb2_grpc.DrafterStub(channel)
        offer = offered_transports(self.device, self.config.transport)
        uuid = ""
        if self.device.type == "cuda":
            from specdec.transport.cuda_ipc import gpu_uuid
            uuid = gpu_uuid(self.device)
        info = stub.Info(pb.DrafterInfoRequest(
            max_drafts=self.config.max_drafts, hidden_size=self.hidden_size, dtype=tensor_bytes.DTYPE_NAMES[self.dtype],
            vocab_size=self.vocab_size, transports=[TRANSPORTS[t] for t in offer], host_id=host_id(), gpu_uuid=uuid,
            model_type=self.model_type), timeout=5.0)
        if info.needs_hidden_states and info.hidden_size != self.hidden_size:
            raise RuntimeError(f"drafter hidden size {info.hidden_size} != target {self.hidden_size}")
        transport = next((t for t in offer if TRANSPORTS[t] in info.transports), None)
        if transport is None:
            raise RuntimeError(f"no common transport (offered {offer}, drafter accepts {list(info.transports)})")
        stub.ClearCache(pb.ClearCacheRequest(), timeout=5.0)
        sender = HiddenSender(transport, self.max_rows, self.hidden_size, self.dtype, self.device) \
            if info.needs_hidden_states else None
        requests: queue.Queue = queue.Queue()
        shared = self.shared_weights if info.needs_shared_weights else {}
        buffers = [_message(pb.SharedBuffer, b) for b in sender.setup(shared)] if sender else []
        requests.put(pb.DraftStepRequest(setup=pb.Setup(buffers=buffers)))
        call = stub.Step(iter(requests.get, _END), timeout=None)
        threading.Thread(target=self._read_responses, args=(call, requests), daemon=True).start()
        with self._lock:
            if self._sender is not None:
                self._sender.close()
            if self._channel is not None:
                self._channel.close()
            self._sender = sender
            self._call, self._requests, self._channel = call, requests, channel
            self._responses = queue.Queue()
            self.kind, self.needs_hidden = info.kind, info.needs_hidden_states
            self.max_drafts = info.max_drafts
            self.transport_name = transport if sender else "none"
            self.generation += 1
            self._pending_release.clear()
        log.info("drafter %s connected at %s: k=%d, transport %s, hidden states %s", info.kind,
                 self.config.address, info.max_drafts, self.transport_name, info.needs_hidden_states)

    def _read_responses(self, call, requests) -> None:
        try:
            for response in call:
                self._responses.put(response)
        except grpc.RpcError as e:
            if self._requests is requests:
                log.warning("drafter stream ended: %s", e.details() if hasattr(e, "details") else e)
        self._disconnect(requests)

    def _disconnect(self, requests) -> None:
        with self._lock:
            if self._requests is not requests or requests is None:
                return
            requests.put(_END)
            if self._call is not None:
                self._call.cancel()
            self._requests, self._call, self.max_drafts = None, None, 0
        self._responses.put(None)
        log.warning("drafter %s lost: decoding without drafts until it is back", self.config.address)
        self._wake.set()

    # ---- Drafter protocol ------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> DraftOutput:
        requests, responses = self._requests, self._responses
        empty = DraftOutput(drafts=[[] for _ in batch.seqs])
        if requests is None:
            self.fallbacks += 1
            return empty
        self._step += 1
        release, self._pending_release = self._pending_release, []
        message = pb.StepInput(step=self._step, release_seq_ids=release, seqs=[
            pb.SeqInput(seq_id=s.seq_id, start_pos=s.start_pos, token_ids=s.token_ids, num_drafts=s.num_drafts)
            for s in batch.seqs])
        if batch.hidden is not None and self._sender is not None:
            message.hidden.CopyFrom(_message(pb.TensorRef, self._sender.send(batch.hidden)))
        start = time.perf_counter()
        requests.put(pb.DraftStepRequest(step=message))
        try:
            response = responses.get(timeout=self.config.step_timeout_s)
        except queue.Empty:
            response = None
            log.warning("drafter step %d timed out after %.1fs", self._step, self.config.step_timeout_s)
        if response is None or response.step != self._step or len(response.drafts) != len(batch.seqs):
            self._disconnect(requests)
            self.fallbacks += 1
            return empty
        self.last_round_trip_ms = (time.perf_counter() - start) * 1e3
        self.last_drafter_ms = response.drafter_ms
        return DraftOutput(drafts=[list(d.token_ids) for d in response.drafts])

    def release(self, seq_ids: list[int]) -> None:
        self._pending_release.extend(seq_ids)  # travels with the next step: no extra round trip

    def clear(self) -> None:
        self._pending_release.clear()

    def close(self) -> None:
        self._closed = True
        self._disconnect(self._requests)
        if self._sender is not None:
            self._sender.close()
