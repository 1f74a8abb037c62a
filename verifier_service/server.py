"""`specdec verifier`: load the target, connect to the drafter, serve verifier.proto until SIGINT / SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.drafting import Drafter, vocabulary_fingerprint
from specdec.models.loader import LoadedModel, load_model
from specdec.rpc import serving
from specdec.rpc.v1 import gateway_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.startup_heap import freeze_startup_heap
from specdec.step_trace import StepTrace
from specdec.transport.shm_buffer import remove_stale_segments

from .drafter_client import DrafterLinkConfig, RemoteDrafter
from .engine import EngineConfig, SpecEngine
from .engine_loop import DEFAULT_MAX_QUEUED, EngineLoop
from .forced_acceptance import ForcedAcceptance
from .metrics import VerifierMetrics
from .model_runner import ModelRunner
from .scheduler import SchedulerConfig
from .servicer import VerifierServicer
from .warm_up import warm_up

log = logging.getLogger(__name__)
SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


@dataclass(frozen=True)
class VerifierConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    num_drafts: int = 3
    drafter_address: str | None = None     # None: plain decoding (k = 0), or the in-process drafter
    in_process_drafter: str | None = None  # a drafter kind run inside this process (built by the caller)
    transport: str = "auto"
    drafter_timeout_s: float = 10.0
    drafter_wait_s: float = 60.0           # at start-up, how long SERVING waits for the drafter link
    step_channel: str = "auto"             # auto: the drafter's local lane on this host | grpc
    max_context: int = 4096
    max_running: int = 16
    max_queued: int = DEFAULT_MAX_QUEUED   # requests waiting beyond max_running; more: RESOURCE_EXHAUSTED
    max_batched_tokens: int = 512
    prefill_chunk: int = 256
    block_size: int = 16
    kv_blocks: int = 0                     # 0: enough for max_running sequences of max_context
    metrics_port: int = 0                  # 0: no Prometheus endpoint
    forced_acceptance_length: float = 0.0  # benchmarks only, with unsafe_forced_acceptance
    unsafe_forced_acceptance: bool = False
    enforce_eager: bool = False            # no CUDA graphs
    overlap: bool = True                   # launch a draft-free step before reading the last one's tokens
    warm_up: bool = True                   # run verifier_service.warm_up before reporting SERVING
    trace_steps: str | None = None         # diagnostics: a specdec.step_trace file

    def context_and_blocks(self, loaded: LoadedModel) -> tuple[int, int]:
        """(the longest sequence served, KV blocks to hold max_running of them unless kv_blocks says)."""
        max_context = min(self.max_context, loaded.config.max_position_embeddings)
        return max_context, self.kv_blocks or self.max_running * math.ceil(max_context / self.block_size)


# Builds the in-process drafter around the loaded target (the CLI passes one: this package imports no drafter).
DrafterFactory = Callable[[LoadedModel, VerifierConfig], Drafter]


def build_engine(config: VerifierConfig, make_drafter: DrafterFactory | None = None) -> SpecEngine:
    if config.in_process_drafter and (config.drafter_address or make_drafter is None):
        raise ValueError("an in-process drafter needs its factory and no --drafter-address")
    loaded = load_model(config.model_dir, dtype=config.dtype, device=config.device)
    max_context, blocks = config.context_and_blocks(loaded)
    runner = ModelRunner(loaded, blocks, config.block_size, config.max_running, config.num_drafts, config.device,
                         max_model_len=max_context, max_batched_tokens=config.max_batched_tokens,
                         enforce_eager=config.enforce_eager)
    trace = StepTrace(config.trace_steps, "verifier")
    drafter = None
    if config.drafter_address and config.num_drafts > 0:
        model = loaded.model
        drafter = RemoteDrafter(
            DrafterLinkConfig(config.drafter_address, config.num_drafts, config.transport, config.drafter_timeout_s,
                              step_channel=config.step_channel),
            loaded.config.hidden_size, loaded.config.vocab_size, model.embed_tokens.weight.dtype,
            torch.device(config.device), config.max_batched_tokens,
            {"embed_tokens": model.embed_tokens.weight, "lm_head": model.lm_head.weight}, loaded.config.model_type,
            vocabulary_fingerprint(config.model_dir), trace, max_seqs=config.max_running)
    elif config.in_process_drafter and config.num_drafts > 0:
        drafter = make_drafter(loaded, config)
        log.info("in-process drafter %s (%s), k=%d: no drafter service", config.in_process_drafter,
                 type(drafter).__name__, config.num_drafts)
    forced = None
    if config.forced_acceptance_length:
        forced = ForcedAcceptance(config.forced_acceptance_length, config.num_drafts,
                                  enabled=config.unsafe_forced_acceptance)
        log.warning("FORCED ACCEPTANCE (mean length %.2f): output is not the target's; benchmarks only",
                    config.forced_acceptance_length)
    scheduler = SchedulerConfig(config.max_running, config.max_batched_tokens, config.prefill_chunk)
    return SpecEngine(runner, drafter, EngineConfig(config.num_drafts, scheduler, forced, max_context, config.overlap),
                      trace)


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
    cfg = engine.runner.config
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
        log.info("drafter %s connected %.1f s after the warm-up", drafter.kind, time.monotonic() - start)
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
    if config.warm_up:
        warm_up(engine)
    if isinstance(engine.drafter, RemoteDrafter):
        wait_for_drafter(engine.drafter, config.drafter_wait_s)
    freeze_startup_heap("verifier")
    engine.trace.mark("serving")   # trace-report leaves the warm-up's steps out
    asyncio.run(_serve(engine, config, host, port))
