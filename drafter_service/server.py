"""`specdec drafter`: serve one drafter over gRPC until SIGINT / SIGTERM."""
from __future__ import annotations

import logging

from specdec.rpc import serving
from specdec.rpc.v1 import drafter_pb2, drafter_pb2_grpc

from .factory import DrafterConfig, DrafterHolder
from .servicer import DrafterServicer

log = logging.getLogger(__name__)
SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


def start(config: DrafterConfig, host: str, port: int) -> serving.RunningServer:
    holder = DrafterHolder(config)  # loads weights before the port reports SERVING
    uuid = ""
    if config.device.startswith("cuda"):
        from specdec.transport.cuda_ipc import gpu_uuid
        uuid = gpu_uuid(config.device)
    servicer = DrafterServicer(holder, uuid)
    running = serving.start_server(lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
                                   [SERVICE], host, port)
    running.set_serving(True)
    log.info("drafter %s (k=%d, %s) listening on %s:%d", config.kind, config.max_drafts, config.device, host,
             running.port)
    return running


def serve(config: DrafterConfig, host: str, port: int) -> None:
    serving.wait_for_termination(start(config, host, port), f"drafter {config.kind}")
