"""`specdec verifier`: load the target, connect to the drafter, serve verifier.proto until SIGINT / SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from specdec.rpc import serving
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.startup_heap import freeze_startup_heap
from specdec.transport.shm_buffer import remove_stale_segments

from .builder import DrafterFactory, VerifierConfig, build_engine
from .drafter_client import RemoteDrafter
from .engine import SpecEngine
from .engine_loop import EngineLoop
from .metrics import VerifierMetrics
from .servicer import VerifierServicer
from .warm_up import measure_step_costs, warm_up

log = logging.getLogger(__name__)
SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


async def start(engine: SpecEngine, config: VerifierConfig, host: str,
                port: int) -> tuple[serving.AioServer, EngineLoop]:
    """Serve a loaded, warmed-up engine (grpc.aio). If the engine dies, health turns NOT_SERVING."""
    metrics = VerifierMetrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port)
    event_loop = asyncio.get_running_loop()
    running: serving.AioServer | None = None

    def on_fatal(error: BaseException) -> None:  # the engine thread: hand the health flip to the event loop
        metrics.engine_failures.inc()
        if running is not None:
            asyncio.run_coroutine_threadsafe(running.set_serving(False), event_loop)
    loop = EngineLoop(engine, on_step=metrics.observe, on_fatal=on_fatal, max_queued=config.max_queued).start()
    cfg = engine.executor.config
    has_tokenizer = (Path(config.model_dir) / "tokenizer.json").is_file()
    info = gateway_pb2.InfoResponse(model=Path(config.model_dir).name, model_type=cfg.model_type,
                                    max_context=engine.max_len, vocab_size=cfg.vocab_size, has_tokenizer=has_tokenizer)
    servicer = VerifierServicer(loop, info)
    running = await serving.start_aio_server(
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), [SERVICE], host, port,
        max_request_bytes=serving.VERIFIER_MAX_REQUEST_BYTES)
    serving.warn_if_exposed("the verifier", host, secured=False)
    await running.set_serving(loop.error is None)
    log.info("verifier %s on %s (%s, k=%d, drafter %s) listening on %s:%d; at most %d requests in flight",
             cfg.model_type, config.device, config.dtype, config.num_drafts, _drafter_name(config), host,
             running.port, loop.capacity)
    return running, loop


def _drafter_name(config: VerifierConfig) -> str:
    if config.in_process_drafter:
        return f"{config.in_process_drafter}, in-process"
    return config.drafter_address or "none"


async def _serve(engine: SpecEngine, config: VerifierConfig, host: str, port: int) -> None:
    running, loop = await start(engine, config, host, port)
    await serving.until_signal("verifier")
    await running.stop()
    loop.stop()
    loop.engine.executor.close()   # the other tensor-parallel ranks, if any
    if isinstance(loop.engine.drafter, RemoteDrafter):  # an in-process drafter has no link to close
        loop.engine.drafter.close()
    loop.engine.trace.close()
    log.info("verifier: stopped")


def wait_for_drafter(drafter: RemoteDrafter, wait_s: float) -> bool:
    """Hold SERVING back until the drafter link is up, for at most wait_s: requests that arrive before it decode
    without drafts (lossless, but up to k + 1 times slower), and a stack whose drafter is still starting would
    otherwise serve its first burst that way. A drafter that does not come in time is waited for no longer:
    the verifier serves, and the link connects whenever the drafter does."""
    start = time.monotonic()
    while not drafter.connected and time.monotonic() - start < wait_s:
        time.sleep(0.05)
    if drafter.connected:
        log.info("the %s drafter's link is up %.1f s after the warm-up: reporting SERVING", drafter.kind,
                 time.monotonic() - start)
    elif wait_s > 0:
        log.warning("no drafter at %s after %.0f s (--drafter-wait): serving without drafts until it connects",
                    drafter.config.address, wait_s)
    return drafter.connected


def serve(config: VerifierConfig, host: str, port: int, make_drafter: DrafterFactory | None = None) -> None:
    removed = remove_stale_segments()   # a killed verifier's buffers (they may hold its clients' tokens)
    if removed:
        log.warning("removed %d shared-memory file(s) of processes that are gone: %s", len(removed),
                    ", ".join(map(str, removed)))
    engine = build_engine(config, make_drafter)  # before the event loop: Ctrl-C / SIGTERM while loading stop the process at once
    if engine.executor.ranks is not None:
        engine.executor.ranks.watch()   # a lost tensor-parallel rank ends this process, for a restart with all
    if config.warm_up:
        warm_up(engine)
    if isinstance(engine.drafter, RemoteDrafter):
        wait_for_drafter(engine.drafter, config.drafter_wait_s)
    if engine.policy.adaptive and engine.drafter is not None:
        measure_step_costs(engine)
    freeze_startup_heap("verifier")
    engine.trace.mark("serving")   # trace-report leaves the warm-up's steps out
    asyncio.run(_serve(engine, config, host, port))
