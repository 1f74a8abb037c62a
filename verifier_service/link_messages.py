"""drafter.proto messages from the plain field dicts that hidden_sender.py and device_exchange.py return (they
stay free of protobuf; the link's two halves build the messages)."""
from __future__ import annotations

from specdec.rpc.v1 import drafter_pb2 as pb

TRANSPORTS = {"inline": pb.INLINE, "shm": pb.SHM, "cuda_ipc": pb.CUDA_IPC}


def link_message(cls, fields: dict):
    """`cls` (SharedBuffer, TensorRef) from its fields; transport names become the enum."""
    return cls(**{k: TRANSPORTS[v] if k == "transport" else v for k, v in fields.items()})
