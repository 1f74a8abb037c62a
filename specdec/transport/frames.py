"""Length-prefixed frames over a stream socket: how the local step lane carries one protobuf message each way
per step. A frame is a 4-byte little-endian length, then that many bytes."""
from __future__ import annotations

import socket
import struct

from specdec.rpc.serving import MAX_MESSAGE_BYTES

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES   # what the gRPC Step stream takes (inline hidden states of a full batch)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes | None:
    """The next frame's bytes; None when the peer closed the socket (between frames or inside one).
    Raises ValueError for a length over MAX_FRAME_BYTES, socket.timeout / OSError as the socket does."""
    head = _recv_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return _recv_exactly(sock, length) if length else b""


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        received = sock.recv_into(view[got:])
        if received == 0:
            return None
        got += received
    return bytes(buffer)
