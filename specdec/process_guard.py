"""Child processes that die with their parent, however the parent ends (SIGKILL included).

`specdec serve` / `generate` start each service as `specdec --parent-pid PID <service> ...`; the child calls
``die_with_parent(PID)`` first thing. On Linux the kernel sends it SIGTERM when the parent exits
(``PR_SET_PDEATHSIG``: immediate, no polling; note it follows the parent *thread* that started the child, so a
stack is started from a thread that lives as long as it, e.g. the main thread). Elsewhere a daemon thread
polls the parent's pid. Either way, a parent that died before the call is caught by comparing ``getppid()``.
SIGTERM (not SIGKILL) lets the service stop cleanly: drain, close its shared memory, exit.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGTERM) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch, args=(parent_pid, sig), name="parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent was gone before we asked
        os.kill(os.getpid(), sig)


def _watch(parent_pid: int, sig: signal.Signals) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), sig)
