"""`specdec serve` watching its three services: a child that dies is noticed, logged, cleaned up and restarted.

Policy (``RestartPolicy``; `specdec serve --help` and the README say the same):
- the drafter is always restarted, after a backoff that doubles from ``backoff_s`` up to ``max_backoff_s``; the
  verifier decodes without drafts meanwhile and reconnects by itself, so speculation resumes once it is back;
- the verifier or the gateway is restarted the same way at most ``max_restarts`` times in a row (a service that
  stayed up and healthy for ``stable_s`` starts its count over); one more death stops the whole stack and
  `serve` exits non-zero, so an outer supervisor (systemd, compose ``restart:``, Kubernetes) sees it.
  ``max_restarts=0``: the first death of either stops the stack.
A dead child is reaped (no ``<defunct>`` entry stays) and its shared-memory segments are removed at once.
"""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable

from specdec.transport.shm_buffer import remove_segments_of

from .local_stack import LocalStack

log = logging.getLogger(__name__)
GIVE_UP_EXIT_CODE = 3          # `serve`'s exit status when a service died more often than the policy allows


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5         # consecutive restarts of the verifier or the gateway before the stack stops
    backoff_s: float = 1.0        # wait before the first restart of a service; doubles with each one after it
    max_backoff_s: float = 30.0
    stable_s: float = 60.0        # a service healthy this long after a restart starts its count over


@dataclass
class _Watch:
    """One service's supervision state: running (both times None), waiting to restart, or restarted and not
    healthy yet."""
    restarts: int = 0
    restart_at: float | None = None     # when to start it again
    started_at: float | None = None     # restarted then, not healthy yet
    healthy_since: float | None = None


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(self, stack: LocalStack, policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic):
        self.stack, self.policy, self.clock = stack, policy, clock
        self.watches = {name: _Watch(healthy_since=clock()) for name in stack.procs}
        self.num_restarts = {name: 0 for name in stack.procs}     # all restarts since start, for the log and tests

    def run(self, poll_s: float = 0.2) -> int:
        """Watch until a service dies more often than the policy allows: return `serve`'s exit status. Signals
        interrupt it (KeyboardInterrupt, see run_stack): sleeps are short."""
        while True:
            code = self.tick()
            if code is not None:
                return code
            time.sleep(poll_s)

    def tick(self) -> int | None:
        """One look at every service; the exit status when the stack must stop, else None."""
        now = self.clock()
        for name, watch in self.watches.items():
            proc = self.stack.procs[name]
            if watch.restart_at is None and proc.poll() is not None:
                if not self._died(name, watch, proc.pid, proc.returncode, now):
                    return GIVE_UP_EXIT_CODE
            elif watch.restart_at is not None and now >= watch.restart_at:
                self.stack.restart(name, wait=False)
                watch.restart_at, watch.started_at = None, now
                self.num_restarts[name] += 1
                log.info("restarted %s (pid %d)", name, self.stack.procs[name].pid)
            elif watch.started_at is not None:
                self._check_started(name, watch, now)
            elif watch.healthy_since is not None and now - watch.healthy_since >= self.policy.stable_s:
                watch.restarts = 0
        return None

    def _died(self, name: str, watch: _Watch, pid: int, code: int, now: float) -> bool:
        """Log and clean up after a dead child, schedule its restart; False when the stack must stop."""
        when = "while starting" if watch.started_at is not None else ""
        removed = remove_segments_of(pid)
        log.error("%s (pid %d) %s%s%s", name, pid, exit_description(code), f" {when}" if when else "",
                  f"; removed its {len(removed)} shared-memory segment(s)" if removed else "")
        watch.started_at = watch.healthy_since = None
        if name != "drafter" and watch.restarts >= self.policy.max_restarts:
            log.error("%s died %d time(s) in a row (--max-restarts %d): stopping the stack", name,
                      watch.restarts + 1, self.policy.max_restarts)
            return False
        delay = min(self.policy.backoff_s * 2 ** watch.restarts, self.policy.max_backoff_s)
        watch.restarts += 1
        watch.restart_at = now + delay
        consequence = {"drafter": "decoding goes on without drafts",
                       "verifier": "requests get UNAVAILABLE", "gateway": "clients cannot connect"}[name]
        log.warning("restarting %s in %.1f s (restart %d in a row); until it is back %s", name, delay,
                    watch.restarts, consequence)
        return True

    def _check_started(self, name: str, watch: _Watch, now: float) -> None:
        if self.stack.is_healthy(name, timeout=0.5):
            log.info("%s is back and healthy (pid %d, %.1f s after its restart)", name, self.stack.procs[name].pid,
                     now - watch.started_at)
            watch.started_at, watch.healthy_since = None, now
        elif now - watch.started_at > self.stack.config.startup_timeout_s:
            log.error("%s not healthy %.0f s after its restart: killing it", name, now - watch.started_at)
            self.stack.procs[name].kill()   # the next tick sees it dead, counts it and schedules the next try
