"""The local lane: the Step stream's messages over an abstract Unix socket, offered in Info to a verifier on
this host. The same DraftStepRequest / DraftStepResponse messages as Step, as length-prefixed frames
(specdec.transport.frames), read and answered by one thread per verifier; the verifier's engine thread writes
and reads its end itself. Step through gRPC costs two thread hand-offs on each side per step; this costs a socket
write and a wake-up each way.

A refused message or a failing drafter closes the socket (the verifier counts a drafter failure for that step
and reconnects), as Step ends with a status."""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading

from google.protobuf.message import DecodeError

from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.step_thread import step_thread_on
from specdec.transport.frames import recv_frame, send_frame

from .step_session import StepSession, StreamRefused

log = logging.getLogger(__name__)


class LocalLane:
    def __init__(self, servicer):
        self.servicer = servicer
        self.name = f"specdec-drafter-{os.getpid()}-{secrets.token_hex(6)}"  # abstract: no file to clean up
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(8)
        self._closed = False
        self._open: set[socket.socket] = set()   # the verifiers' connections, ended when the server stops
        threading.Thread(target=self._accept, name="local-lane", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return   # closed
            self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="local-lane-steps", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        session = StepSession(self.servicer)
        step_thread_on(self.servicer.holder.config.device)  # this thread runs every step
        log.info("verifier connected: step stream open on the local lane")
        with conn:   # closed after the reason is logged: the verifier sees the end after the log has it
            try:
                while (frame := recv_frame(conn)) is not None:
                    response = session.handle(pb.DraftStepRequest.FromString(frame))
                    if response is not None:
                        send_frame(conn, response.SerializeToString())
            except StreamRefused as e:
                log.warning("local lane closed: %s: %s", e.code.name, e.details)
            except (OSError, ValueError, DecodeError) as e:   # the verifier went away mid-frame, or sent garbage
                if not self._closed:
                    log.warning("local lane closed: %s", e)
        self._open.discard(conn)
        log.info("verifier disconnected: local lane closed after step %d", session.last_step)

    def close(self) -> None:
        """Stop listening and end every open lane (as stopping the gRPC server ends its Step streams)."""
        self._closed = True
        for sock in [self._listener, *self._open]:
            try:
                sock.shutdown(socket.SHUT_RDWR)   # wakes the thread blocked on it
            except OSError:
                pass
        self._listener.close()
