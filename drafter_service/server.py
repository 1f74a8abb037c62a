"""`specdec drafter`: serve one drafter over gRPC until SIGINT / SIGTERM."""
from __future__ import annotations

import logging

from specdec.drafting.token_counts import TokenCounter
from specdec.rpc import serving
from specdec.rpc.v1 import drafter_pb2, drafter_pb2_grpc
from specdec.startup_heap import freeze_startup_heap
from specdec.step_thread import use_gpu_in_this_thread
from specdec.step_trace import StepTrace

from .factory import DrafterConfig, DrafterHolder
from .local_lane import LocalLane
from .servicer import DrafterServicer

log = logging.getLogger(__name__)
SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


def start(config: DrafterConfig, host: str, port: int) -> serving.RunningServer:
    """Serve `config`'s drafter; stopping the returned server also saves the token counts (--count-tokens)."""
    # first, so that a counts file of another vocabulary fails before any weights load
    c = config
    counter = TokenCounter(c.count_tokens, c.vocab_size, c.count_every_s) if c.count_tokens else None
    use_gpu_in_this_thread(config.device)   # this thread loads the weights and captures the graphs there
    holder = DrafterHolder(config)  # loads weights before the port reports SERVING
    uuid = ""
    if config.device.startswith("cuda"):
        from specdec.transport.cuda_ipc import gpu_uuid
        uuid = gpu_uuid(config.device)
    servicer = DrafterServicer(holder, uuid, counter, StepTrace(config.trace_steps, "drafter"))
    lane = LocalLane(servicer)   # before the port: every Info answer names it
    servicer.local_lane = lane.name
    try:
        running = serving.start_server(lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
                                       [SERVICE], host, port)
    except BaseException:
        lane.close()
        raise
    running.on_stop.append(lane.close)
    running.on_stop.append(servicer.close)
    running.set_serving(True)
    log.info("drafter %s (k=%d, %s) listening on %s:%d", config.kind, config.max_drafts, config.device, host,
             running.port)
    return running


def serve(config: DrafterConfig, host: str, port: int) -> None:
    running = start(config, host, port)
    freeze_startup_heap(f"drafter {config.kind}")
    serving.wait_for_termination(running, f"drafter {config.kind}")
