"""The two ways the verifier's per-step messages reach the drafter: the gRPC Step stream, and the local lane (an
abstract Unix socket a drafter on this host offers in Info; drafter_service/local_lane.py). Both carry the same
DraftStepRequest / DraftStepResponse messages and look the same to RemoteDrafter: send, receive with a timeout,
close.

Through gRPC each message crosses two threads per side (gRPC's sending thread takes it from a queue; a reader
thread hands the answer to the engine through another). On the local lane the engine thread writes the frame
and reads the answer itself: no thread between it and the drafter's step thread."""
from __future__ import annotations

import queue
import select
import socket
import threading
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.step_trace import StepTrace
from specdec.transport.frames import recv_frame, send_frame

_END = object()


class GrpcStepStream:
    channel = "gRPC"

    def __init__(self, stub, setup: pb.DraftStepRequest, trace: StepTrace):
        self.trace = trace
        self.requests: queue.Queue = queue.Queue()     # for gRPC's sending thread; _END ends the stream
        self.responses: queue.Queue = queue.Queue()    # from the reader thread; None: the stream ended
        self.requests.put(setup)
        self.call = stub.Step(self._outgoing(), timeout=None)

    def start(self, on_end: Callable[[str], None]) -> None:
        """Read answers on a thread of their own; on_end(why) when the stream ends."""
        threading.Thread(target=self._read, args=(on_end,), name="drafter-answers", daemon=True).start()

    def _outgoing(self):
        """The messages as gRPC's sending thread takes them (traced: when it took each step)."""
        for message in iter(self.requests.get, _END):
            if self.trace.enabled and message.HasField("step"):
                self.trace.mark("link.taken", message.step.step)
            yield message

    def _read(self, on_end: Callable[[str], None]) -> None:
        why = "the drafter ended the stream"
        try:
            for response in self.call:
                self.trace.mark("link.answer", response.step)
                self.responses.put(response)
        except grpc.RpcError as e:
            why = e.details() if hasattr(e, "details") else str(e)
        self.responses.put(None)
        on_end(why)

    def send(self, message: pb.DraftStepRequest) -> None:
        self.requests.put(message)

    def receive(self, timeout: float) -> pb.DraftStepResponse | None:
        """The next answer; None if none came within `timeout` seconds or the stream ended."""
        try:
            return self.responses.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.requests.put(_END)
        self.call.cancel()
        self.responses.put(None)


class LocalStepStream:
    channel = "the local lane"

    def __init__(self, name: str, setup: pb.DraftStepRequest, trace: StepTrace, send_timeout_s: float):
        """Connect to the drafter's lane `name` (raises OSError when it cannot be reached from here: another
        network namespace, say) and send the setup. A step message that the drafter does not take within
        `send_timeout_s` (it stopped reading) fails its send."""
        self.trace, self.send_timeout_s = trace, send_timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(max(send_timeout_s, 5.0))
            self.sock.connect("\0" + name)
            send_frame(self.sock, setup.SerializeToString())
        except OSError:
            self.sock.close()
            raise

    def start(self, on_end: Callable[[str], None]) -> None:
        """Watch for the drafter's end of the socket closing (on_end then), so that a drafter that goes away
        while the engine idles shows at once; the watcher only polls, the engine thread reads the answers."""
        threading.Thread(target=self._watch, args=(on_end,), name="drafter-lane-watch", daemon=True).start()

    def _watch(self, on_end: Callable[[str], None]) -> None:
        watch = select.poll()
        try:
            watch.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)  # not POLLIN: answers
            while not watch.poll():
                pass
        except (OSError, ValueError):   # closed here meanwhile
            pass
        on_end("the drafter closed the local lane")

    def send(self, message: pb.DraftStepRequest) -> None:
        """Raises OSError when the drafter is gone or takes no bytes for send_timeout_s."""
        payload = message.SerializeToString()
        self.trace.mark("link.taken", message.step.step)   # no thread takes it: this thread writes it now
        self.sock.settimeout(self.send_timeout_s)   # not what the last receive left: its deadline's rest
        send_frame(self.sock, payload)

    def receive(self, timeout: float) -> pb.DraftStepResponse | None:
        try:
            self.sock.settimeout(max(timeout, 1e-3))
            frame = recv_frame(self.sock)
            response = pb.DraftStepResponse.FromString(frame) if frame is not None else None
        except (OSError, ValueError, DecodeError):   # socket.timeout is an OSError
            return None
        if response is not None:
            self.trace.mark("link.answer", response.step)
        return response

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes a receive on another thread
        except OSError:
            pass
        self.sock.close()
