"""drafter.proto messages from the plain field dicts that hidden_sender.py and device_exchange.py return (they
stay free of protobuf; the link's two halves build the messages)."""
from __future__ import annotations

from specdec.drafting import PrefixBlocks
from specdec.rpc.v1 import drafter_pb2 as pb

TRANSPORTS = {"inline": pb.INLINE, "shm": pb.SHM, "cuda_ipc": pb.CUDA_IPC}


def link_message(cls, fields: dict):
    """`cls` (SharedBuffer, TensorRef) from its fields; transport names become the enum."""
    return cls(**{k: TRANSPORTS[v] if k == "transport" else v for k, v in fields.items()})


def prefix_messages(prefixes: list[PrefixBlocks]) -> list[pb.PrefixBlocks]:
    """The drafter interface's PrefixBlocks as drafter.proto's."""
    return [pb.PrefixBlocks(seq_id=p.seq_id, hashes=p.hashes, block_size=p.block_size, resumed=p.resumed,
                            checkpoint=p.checkpoint) for p in prefixes]
