"""Runs the engine on its own thread; gRPC handler threads talk to it only through queues.

submit() returns a queue of RequestOutputs for that request; abort() may come from any thread (a cancelled
client). The loop applies adds and aborts between steps, steps while there is work, and sleeps otherwise.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from specdec.sampling_params import SamplingParams

from .engine import RequestOutput, SpecEngine

log = logging.getLogger(__name__)


@dataclass
class Failed:
    """Put on a request's queue when its request could not be added (the message says why)."""
    error: Exception


class EngineLoop:
    def __init__(self, engine: SpecEngine, on_step=None):
        self.engine, self.on_step = engine, on_step
        self._commands: queue.Queue = queue.Queue()
        self._outputs: dict[str, queue.Queue] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> queue.Queue:
        out: queue.Queue = queue.Queue()
        self._commands.put(("add", request_id, prompt_ids, params, out))
        self._wake.set()
        return out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _apply(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, rid, prompt, params, out = command
                try:
                    self.engine.add_request(rid, prompt, params)
                    self._outputs[rid] = out
                except (ValueError, OverflowError) as e:
                    out.put(Failed(e))
            else:
                rid = command[1]
                if self.engine.abort(rid):
                    log.info("request %s aborted; its KV blocks and GDN slot are free", rid)
                    out = self._outputs.pop(rid, None)
                    if out is not None:
                        out.put(None)

    def _run(self) -> None:
        while not self._stop:
            self._apply()
            if not self.engine.has_work:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # our bug: fail what is running, keep serving the rest
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            if self.on_step:
                self.on_step(self.engine, outputs, time.perf_counter() - start)
            for o in outputs:
                self._deliver(o)

    def _deliver(self, output: RequestOutput) -> None:
        out = self._outputs.get(output.request_id)
        if out is None:
            return
        out.put(output)
        if output.finish_reason is not None:
            self._outputs.pop(output.request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._outputs):
            self.engine.abort(rid)
            self._outputs.pop(rid).put(Failed(error))
