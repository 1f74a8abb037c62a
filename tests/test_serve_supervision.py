"""`specdec serve` supervises its services (issue 34, defect 1): a dead drafter is restarted and speculation
resumes; a dead verifier is restarted, its shared memory removed, no zombie left; past --max-restarts the stack
stops and `serve` exits non-zero. The policy itself is checked with fake processes and a fake clock."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from reliability_stack import SERVING, Serve, children, generate, health, state, wait_for

from specdec.rpc.v1 import gateway_pb2_grpc
from specdec_tools.stack_supervisor import GIVE_UP_EXIT_CODE, RestartPolicy, Supervisor

pytestmark = pytest.mark.timeout(300)


# ---- the policy, with fake processes ------------------------------------------------------------------------
class FakeProc:
    _pids = iter(range(900_000, 1_000_000))

    def __init__(self):
        self.pid, self.returncode = next(self._pids), None

    def poll(self):
        return self.returncode


class FakeStack:
    def __init__(self, names=("drafter", "verifier", "gateway")):
        self.procs = {n: FakeProc() for n in names}
        self.config = SimpleNamespace(startup_timeout_s=600.0)
        self.healthy = set(names)
        self.restarted: list[str] = []

    def restart(self, name, wait=True):
        self.procs[name] = FakeProc()
        self.restarted.append(name)

    def is_healthy(self, name, timeout=1.0):
        return name in self.healthy


def kill(stack: FakeStack, name: str) -> None:
    stack.procs[name].returncode = -9


def test_policy_restarts_the_drafter_with_a_doubling_backoff_and_gives_up_on_the_verifier():
    now = [0.0]
    stack = FakeStack()
    sup = Supervisor(stack, RestartPolicy(max_restarts=2, backoff_s=1.0, max_backoff_s=4.0, stable_s=60.0),
                     clock=lambda: now[0])
    delays = []
    for _ in range(5):                     # the drafter: every death restarted, 1, 2, 4, 4, 4 s later
        kill(stack, "drafter")
        assert sup.tick() is None
        died_at, before = now[0], len(stack.restarted)
        while len(stack.restarted) == before:
            now[0] += 0.25
            assert sup.tick() is None
        delays.append(now[0] - died_at)
        now[0] += 0.25
        sup.tick()                         # healthy again
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0] and stack.restarted == ["drafter"] * 5

    for _ in range(2):                     # the verifier: two restarts in a row ...
        kill(stack, "verifier")
        assert sup.tick() is None
        now[0] += 10.0
        assert sup.tick() is None and stack.restarted[-1] == "verifier"
        now[0] += 1.0
        sup.tick()
    kill(stack, "verifier")                # ... a third death in a row stops the stack
    assert sup.tick() == GIVE_UP_EXIT_CODE


def test_policy_count_starts_over_after_a_stable_period_and_counts_failed_starts():
    now = [0.0]
    stack = FakeStack()
    sup = Supervisor(stack, RestartPolicy(max_restarts=1, backoff_s=1.0, stable_s=60.0), clock=lambda: now[0])
    for _ in range(3):                     # one death at a time, each after 61 s of health: never gives up
        kill(stack, "gateway")
        assert sup.tick() is None
        now[0] += 1.0
        assert sup.tick() is None          # restarted
        now[0] += 1.0
        assert sup.tick() is None          # healthy
        now[0] += 61.0
        assert sup.tick() is None          # stable: count over
    assert stack.restarted == ["gateway"] * 3
    kill(stack, "gateway")
    sup.tick()
    now[0] += 1.0
    sup.tick()                             # restarted, not healthy yet ...
    kill(stack, "gateway")                 # ... and dead while starting: the second in a row
    assert sup.tick() == GIVE_UP_EXIT_CODE


def test_policy_zero_restarts_stops_at_the_first_death_of_the_verifier_but_restarts_the_drafter():
    now = [0.0]
    stack = FakeStack()
    sup = Supervisor(stack, RestartPolicy(max_restarts=0), clock=lambda: now[0])
    kill(stack, "drafter")
    assert sup.tick() is None
    kill(stack, "verifier")
    assert sup.tick() == GIVE_UP_EXIT_CODE


# ---- the real thing -------------------------------------------------------------------------------------------
def tokens(address: str, prompt: list[int], max_tokens: int = 12):
    with grpc.insecure_channel(address) as channel:
        ids, replies = generate(gateway_pb2_grpc.GatewayStub(channel), prompt, max_tokens)
    return ids, replies[-1].usage


def segments_of(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"specdec-{pid}-*"))


def test_serve_restarts_a_killed_drafter_and_verifier(tiny_dir, tmp_path):
    serve = Serve(str(tiny_dir), tmp_path, "--drafter", "mtp", "--transport", "shm")
    try:
        prompt = [3, 17, 42, 99, 5]
        before, usage = tokens(serve.address, prompt)
        assert usage.draft_tokens > 0
        kids = children(serve.proc.pid)

        os.kill(kids["drafter"], signal.SIGKILL)
        wait_for(lambda: "drafter is back and healthy" in serve.text(), 120, "the drafter restarted")
        assert state(kids["drafter"]) is None, "the dead drafter was not reaped"
        assert f"drafter (pid {kids['drafter']}) was killed by SIGKILL" in serve.text()

        def speculates_again():
            ids, usage = tokens(serve.address, prompt)
            assert ids == before
            return usage.draft_tokens > 0
        wait_for(speculates_again, 60, "drafts again after the drafter's restart")

        verifier = kids["verifier"]
        os.kill(verifier, signal.SIGKILL)
        wait_for(lambda: f"verifier (pid {verifier}) was killed by SIGKILL" in serve.text(), 5, "the death logged")
        assert state(verifier) is None, "the dead verifier was not reaped"
        assert segments_of(verifier) == []
        wait_for(lambda: "verifier is back and healthy" in serve.text(), 180, "the verifier restarted")
        wait_for(lambda: health(serve.address) == SERVING, 30, "the gateway follows the new verifier")
        wait_for(speculates_again, 60, "the new verifier drafts with the drafter")
        assert "Traceback" not in serve.text()
    finally:
        serve.stop()


def test_serve_stops_and_exits_non_zero_past_max_restarts(tiny_dir, tmp_path):
    serve = Serve(str(tiny_dir), tmp_path, "--drafter", "none", "--max-restarts", "0")
    kids = children(serve.proc.pid)
    try:
        os.kill(kids["verifier"], signal.SIGKILL)
        assert serve.proc.wait(60) == GIVE_UP_EXIT_CODE
        wait_for(lambda: all(state(p) in (None, "Z") for p in kids.values()), 30, "every service gone")
        assert "stopping the stack" in serve.text()
    finally:
        serve.stop()
