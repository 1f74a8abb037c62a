"""No service outlives `specdec serve` (issue 13, defect 3): SIGKILL of the parent, SIGTERM once serving, and
Ctrl-C (SIGINT) or SIGHUP while the services are still loading all leave no child behind."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_stack import wait_for

pytestmark = pytest.mark.timeout(300)


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended between listing and reading: it has no children to give
            continue
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited (its parent may be an init that does not reap)


@pytest.mark.parametrize("sig,when", [(signal.SIGKILL, "serving"), (signal.SIGTERM, "serving"),
                                      (signal.SIGINT, "loading"), (signal.SIGHUP, "loading")],
                         ids=["kill-serving", "term-serving", "ctrl-c-loading", "hup-loading"])
def test_no_service_outlives_serve(tiny_dir, tmp_path, sig, when):
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model", str(tiny_dir), "--device", "cpu",
                              "--drafter", "none", "--port", "0"], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own process group: our signal goes to it alone
    kids = []
    try:
        wait_for(lambda: len(children(serve.pid)) == 2, 60, "verifier and gateway started")
        kids = children(serve.pid)
        if when == "serving":
            wait_for(lambda: "specdec serving" in log.read_text(), 180, "stack serving")
        os.kill(serve.pid, sig)
        serve.wait(60)
        wait_for(lambda: not any(alive(k) for k in kids), 30, f"children {kids} gone after {sig.name}")
        text = log.read_text()
        assert "Traceback" not in text
        if sig != signal.SIGKILL:
            assert "stopping" in text or "shutting down" in text
    finally:
        for pid in [serve.pid] + kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
