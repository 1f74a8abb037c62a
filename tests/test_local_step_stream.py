"""The verifier's end of the local lane (verifier_service/step_streams.py, specdec/transport/frames.py) against a
lane served by the test: sends keep their own timeout, frames take what the gRPC Step stream takes, and a step
never writes hidden rows into a connection a reconnect has replaced."""
import secrets
import socket
import threading
import time
from types import SimpleNamespace

import torch

from specdec.drafting import DraftBatch, DraftInput
from specdec.rpc.serving import MAX_MESSAGE_BYTES
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.step_trace import OFF
from specdec.transport.frames import recv_frame, send_frame
from verifier_service.step_streams import LocalStepStream


class SlowLane:
    """An abstract-socket listener whose one connection reads frames in small pieces (a busy drafter)."""

    def __init__(self):
        self.name = f"specdec-test-lane-{secrets.token_hex(4)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.name)
        self.listener.listen(1)
        self.frames: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            while True:
                head = self._read(conn, 4)
                if head is None:
                    return
                self.frames.append(self._read(conn, int.from_bytes(head, "little")))

    @staticmethod
    def _read(conn, n):
        chunks, got = [], 0
        while got < n:
            chunk = conn.recv(min(256 << 10, n - got))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
            time.sleep(0.002)   # slower than one buffer-full: the sender blocks again and again
        return b"".join(chunks)

    def close(self):
        self.listener.close()


def test_a_send_after_a_receive_that_ran_out_keeps_the_send_timeout():
    """A receive that gives up leaves its (short) deadline on the socket; the next step's send must not inherit
    it: a large step message to a drafter that reads slowly still gets through."""
    lane = SlowLane()
    stream = LocalStepStream(lane.name, pb.DraftStepRequest(setup=pb.Setup()), OFF, send_timeout_s=10.0)
    try:
        assert stream.receive(0.001) is None               # no answer within 1 ms: the socket's timeout is 1 ms now
        big = pb.DraftStepRequest(step=pb.StepInput(step=1, seqs=[pb.SeqInput(seq_id=1, token_ids=[7] * (2 << 20))]))
        stream.send(big)                                    # ~4 MB, read in 256 KB pieces every 2 ms: > 1 ms
        stream.close()
        lane.thread.join(10)
        assert len(lane.frames) == 2 and pb.DraftStepRequest.FromString(lane.frames[1]) == big
    finally:
        stream.close()
        lane.close()


def test_frames_as_large_as_the_grpc_limit_pass_and_larger_ones_are_refused():
    a, b = socket.socketpair()
    try:
        payload = bytes(range(256)) * ((65 << 20) // 256)   # 65 MiB: over the lane's old limit, under gRPC's
        writer = threading.Thread(target=send_frame, args=(a, payload))
        writer.start()
        assert recv_frame(b) == payload
        writer.join()
        a.sendall((MAX_MESSAGE_BYTES + 1).to_bytes(4, "little"))
        try:
            recv_frame(b)
            raise AssertionError("a frame over the limit was read")
        except ValueError as e:
            assert "at most" in str(e)
    finally:
        a.close()
        b.close()


def test_a_step_writes_no_hidden_rows_into_a_replaced_connection(tiny_model):
    """The engine takes this step's connection first; if a reconnect replaces it (and closes its sender) before
    the hidden rows are written, the step fails (k = 0) rather than write into a closed buffer."""
    from test_drafter_handshake import _remote
    from verifier_service.drafter_link import LinkConnection
    written = []
    sender = SimpleNamespace(send=lambda hidden: written.append(hidden))
    stream = SimpleNamespace(close=lambda: None, channel="test", send=lambda message: None)
    remote = _remote(tiny_model, "127.0.0.1:1")   # nothing listens: the link thread only retries
    old, new = LinkConnection(stream, sender), LinkConnection(stream, sender)
    known_part = remote._known_part

    def reconnect_meanwhile(batch):
        remote.link.connection = new                   # what the link thread publishes after a reconnect
        return known_part(batch)
    try:
        remote.link.connection = old
        remote._known_part = reconnect_meanwhile
        batch = DraftBatch(step=1, seqs=[DraftInput(seq_id=1, start_pos=0, token_ids=[3, 4], num_drafts=3)],
                           hidden=torch.zeros(2, tiny_model.config.hidden_size))
        out = remote.propose_later(batch)()
        assert out.failure and "replaced" in out.failure and written == []
    finally:
        remote.link.connection = None
        remote.close()
