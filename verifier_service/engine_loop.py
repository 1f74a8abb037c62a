"""Runs the engine on its own thread; request handlers talk to it only through commands and callbacks.

``submit()`` hands over one request with a ``deliver`` callback that receives its RequestOutputs (and, if it
fails, one ``Failed``) on the engine thread; it returns a ``Ticket``: the handle of that one call. Requests are
keyed per call: ``cancel(ticket)`` ends that call's request only, so a second call that reuses a running
request id (refused) can never abort the first. ``abort(request_id)`` (the Abort RPC) ends whichever call
runs under that id. Every request that ends is told so: a last output with a finish_reason ("abort"
included) or a ``Failed``.

Admission is bounded: at most ``max_running + max_queued`` requests are in the verifier; ``submit`` beyond that
raises ``QueueFull``. Any exception that escapes the loop (a step, a stats hook, the loop's own code) is fatal:
it is logged, every request in flight gets ``Failed(INTERNAL)``, ``on_fatal`` runs (the server flips health
to NOT_SERVING) and later submits raise ``EngineStopped``.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specdec.sampling_params import SamplingParams
from specdec.step_thread import step_thread_on

from .engine import SpecEngine
from .requests import RequestOutput

log = logging.getLogger(__name__)
DEFAULT_MAX_QUEUED = 256


class FailureKind(enum.Enum):
    INVALID = "invalid"          # the request is malformed (INVALID_ARGUMENT)
    TOO_LONG = "too_long"        # prompt + max_tokens exceed the context (RESOURCE_EXHAUSTED)
    INTERNAL = "internal"        # our bug: the engine stopped (INTERNAL)


@dataclass
class Failed:
    """The last thing a request's callback receives when it could not be added or the engine died."""
    kind: FailureKind
    message: str


class QueueFull(Exception):
    """More requests than max_running + max_queued (RESOURCE_EXHAUSTED)."""


class EngineStopped(Exception):
    """The engine died earlier; nothing is accepted any more (UNAVAILABLE)."""


@dataclass(eq=False)
class Ticket:
    """One call's request: its engine request id and where its outputs go."""
    request_id: str
    deliver: Callable[[RequestOutput | Failed], None]
    ended: bool = field(default=False)


class EngineLoop:
    def __init__(self, engine: SpecEngine, on_step=None, on_fatal: Callable[[BaseException], None] | None = None,
                 max_queued: int = DEFAULT_MAX_QUEUED):
        self.engine, self.on_step, self.on_fatal = engine, on_step, on_fatal
        self.capacity = engine.scheduler.config.max_running + max_queued
        self.error: BaseException | None = None    # set once the loop died
        self._lock = threading.Lock()              # guards _commands, _in_flight, error
        self._commands: deque = deque()
        self._in_flight = 0                        # tickets submitted and not ended
        self._tickets: dict[str, Ticket] = {}      # admitted to the engine, by request id
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

    # ---- any thread ----------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               deliver: Callable[[RequestOutput | Failed], None]) -> Ticket:
        """Queue a request; raises QueueFull or EngineStopped (then nothing was queued)."""
        ticket = Ticket(request_id, deliver)
        with self._lock:
            if self.error is not None:
                raise EngineStopped(f"the engine stopped after an internal error ({_describe(self.error)}); "
                                    "restart the verifier")
            if self._in_flight >= self.capacity:
                raise QueueFull(f"the verifier is full: {self._in_flight} requests running or waiting "
                                f"(--max-running + --max-queued = {self.capacity}); retry later")
            self._in_flight += 1
            self.engine.trace.mark("request.submitted")   # (before the engine's thread can take it)
            self._commands.append(("add", ticket, prompt_ids, params))
        self._wake.set()
        return ticket

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar in the caller's thread (GrammarError if it does not compile), so that the
        engine's thread finds it compiled when the request is added."""
        self.engine.check_grammar(params)

    def cancel(self, ticket: Ticket) -> None:
        """The caller of this ticket went away (or is done: then a no-op)."""
        self._command(("cancel", ticket))

    def abort(self, request_id: str) -> None:
        """End the request running under `request_id`, whichever call it came from."""
        self._command(("abort", request_id))

    def is_running(self, request_id: str) -> bool:
        return request_id in self._tickets

    def _command(self, command: tuple) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        step_thread_on(self.engine.executor.device)
        try:
            while not self._stop:
                self._apply()
                if not self.engine.has_work:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                if self.on_step:
                    self.on_step(self.engine, outputs, time.perf_counter() - start)
                for o in outputs:
                    self._deliver(o)
                self.engine.trace.mark("outputs.delivered")
        except BaseException as e:  # noqa: BLE001 - whatever it is, the requests must hear of it
            self._die(e)

    def _apply(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "cancel":
                ticket = command[1]
                if self._tickets.get(ticket.request_id) is ticket:
                    self._abort(ticket)
            else:
                ticket = self._tickets.get(command[1])
                if ticket is not None:
                    self._abort(ticket)

    def _add(self, ticket: Ticket, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(ticket.request_id, prompt_ids, params)
        except OverflowError as e:
            self._end(ticket, Failed(FailureKind.TOO_LONG, str(e)))
            return
        except ValueError as e:
            self._end(ticket, Failed(FailureKind.INVALID, str(e)))
            return
        self._tickets[ticket.request_id] = ticket

    def _abort(self, ticket: Ticket, notify: bool = True) -> None:
        """Remove the request from the engine; its caller gets a last output with finish_reason "abort"."""
        seq = self.engine.by_request.get(ticket.request_id)
        del self._tickets[ticket.request_id]
        if seq is None or not self.engine.abort(ticket.request_id):
            self._end(ticket, None)
            return
        log.info("request %s aborted; its KV blocks and GDN slot are free", ticket.request_id)
        last = RequestOutput(ticket.request_id, [], "abort", seq.stats, seq.num_prompt)
        self._end(ticket, last if notify else None)

    def _deliver(self, output: RequestOutput) -> None:
        ticket = self._tickets.get(output.request_id)
        if ticket is None:
            return
        if output.finish_reason is not None:
            del self._tickets[output.request_id]
            self._end(ticket, output)
        elif not self._send(ticket, output):
            self._abort(ticket, notify=False)  # nobody reads this request any more

    def _end(self, ticket: Ticket, last: RequestOutput | Failed | None) -> None:
        """The ticket's last message (None: nothing to say); frees its place in the admission bound."""
        if ticket.ended:
            return
        ticket.ended = True
        with self._lock:
            self._in_flight -= 1
        if last is not None:
            self._send(ticket, last)

    def _send(self, ticket: Ticket, item: RequestOutput | Failed) -> bool:
        try:
            ticket.deliver(item)
            return True
        except Exception as e:  # the handler's side is gone (e.g. its event loop closed): drop this request only
            log.warning("request %s: cannot deliver its output (%s); ending it", ticket.request_id, _describe(e))
            return False

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
            pending = [c[1] for c in self._commands if c[0] == "add"]
            self._commands.clear()
        tickets = list(self._tickets.values()) + pending
        self._tickets.clear()
        log.critical("engine loop stopped by an internal error; failing %d requests in flight, reporting "
                     "NOT_SERVING", len(tickets), exc_info=error)
        failure = Failed(FailureKind.INTERNAL, f"internal error in the verifier's engine: {_describe(error)}")
        for ticket in tickets:
            self._end(ticket, failure)
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:
                log.exception("on_fatal hook failed")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
