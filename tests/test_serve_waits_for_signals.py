"""`specdec serve`'s supervision loop sees its stop signal whichever thread the kernel gave it to."""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

PROGRAM = textwrap.dedent("""
    import os, signal, threading, time
    from types import SimpleNamespace
    from specdec_tools.stack_supervisor import Supervisor

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    ready = threading.Event()

    def other_thread():                 # SIGTERM unblocked here only: the kernel must deliver it to this thread
        ready.wait()
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    threading.Thread(target=other_thread, daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})   # the main thread's mask only
    ready.set()
    try:
        Supervisor(SimpleNamespace(procs={})).run()     # a stack with no service: it watches until stopped
    except KeyboardInterrupt:
        print("stopped", flush=True)
""")


def test_a_signal_taken_by_another_thread_still_stops_the_wait():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and out.stdout.strip() == "stopped", out.stderr
