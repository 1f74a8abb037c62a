"""The three services as separate local processes on 127.0.0.1 (what `specdec serve` runs), or two when the
drafter runs inside the verifier's process (`drafter_in_process`: what `specdec generate` does on a CPU).

No child outlives the stack: each is started with `--parent-pid` (it gets SIGTERM when this process exits,
even by SIGKILL; see specdec.process_guard), a failed or interrupted start stops what was started, and
``run_stack`` turns SIGTERM and SIGHUP into the same clean stop as Ctrl-C. Start a stack from a thread that
lives as long as it (the main thread): on Linux the children follow the thread that started them.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.rpc.health_probe import is_serving
from specdec.transport.host import free_port

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def services_of(serve_pid: int) -> dict[str, int]:
    """The live services of a `specdec serve` process by name, from its children's command lines (Linux /proc):
    for tools and tests that kill one and watch it come back."""
    out = {}
    for task in Path(f"/proc/{serve_pid}/task").iterdir():
        for kid in (task / "children").read_text().split():
            try:
                argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            name = next((a.decode() for a in argv if a in (b"verifier", b"drafter", b"gateway")), None)
            if name:
                out[name] = int(kid)
    return out


@dataclass(frozen=True)
class StackConfig:
    model: str
    drafter: str = "mtp"              # a drafter kind (mtp | draft_model | ngram | synthetic | a plugin) or none
    num_drafts: int = 3
    drafter_in_process: bool = False  # the drafter (mtp | ngram) inside the verifier's process: no drafter service
    device: str = "cpu"
    dtype: str = "float32"
    port: int = 50051                 # the gateway's (0: any free port)
    http_port: int | None = None      # the gateway's OpenAI-compatible HTTP API (None: off, 0: any free port)
    transport: str = "auto"
    verifier_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()  # e.g. ("--draft-model", DIR) or ("--option", "KEY=VALUE")
    gateway_args: tuple[str, ...] = ()  # e.g. ("--api-key-file", FILE, "--metrics-port", "9100")
    gateway_host: str = "127.0.0.1"   # where the gateway listens (the verifier and the drafter stay on loopback)
    gateway_tls: bool = False         # the gateway serves TLS: its health is probed as an open port
    log_dir: str | None = None        # None: children log to this terminal
    startup_timeout_s: float = 600.0


@dataclass
class LocalStack:
    config: StackConfig
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    address: str = ""

    def _spawn(self, name: str, args: list[str]) -> None:
        out = None
        if self.config.log_dir:
            out = open(Path(self.config.log_dir) / f"{name}.log", "a")
        cmd = [sys.executable, "-m", "specdec", "--parent-pid", str(os.getpid()), *args]
        self.commands[name] = args
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                            start_new_session=True)  # Ctrl-C reaches us; we stop them in order
        (log.debug if self.config.log_dir else log.info)("started %s (pid %d): %s", name, self.procs[name].pid,
                                                          " ".join(cmd))

    def is_healthy(self, name: str, timeout: float = 1.0) -> bool:
        """`name` reports SERVING. A TLS gateway (whose certificate this process may not be able to check, and
        which may want a client certificate) counts as healthy once it accepts connections: its health follows
        the verifier's, which is probed in plaintext."""
        if name == "gateway" and self.config.gateway_tls:
            try:
                socket.create_connection((self.host_of(name).strip("[]"), self.ports[name]), timeout=timeout).close()
                return True
            except OSError:
                return False
        return is_serving(f"{self.host_of(name)}:{self.ports[name]}", timeout=timeout)

    def host_of(self, name: str) -> str:
        """The address a service is reached at from this host."""
        host = self.config.gateway_host if name in ("gateway", "http") else "127.0.0.1"
        return "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host

    def _wait_healthy(self, name: str) -> None:
        address = f"{self.host_of(name)}:{self.ports[name]}"
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self.is_healthy(name):
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with code {self.procs[name].returncode} while starting"
                                   + (f"; see {self.config.log_dir}/{name}.log" if self.config.log_dir else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} at {address} not healthy after {self.config.startup_timeout_s:.0f}s")
            time.sleep(0.2)

    def _wait_drafter_link(self, timeout_s: float = 60.0) -> None:
        """Until the verifier reports its drafter connected: the first requests then get drafts. (The verifier holds
        SERVING back for its --drafter-wait, but a drafter that became healthy after that is found later.)"""
        import grpc

        from specdec.rpc.v1 import verifier_pb2, verifier_pb2_grpc
        deadline = time.monotonic() + min(timeout_s, self.config.startup_timeout_s)
        with grpc.insecure_channel(f"127.0.0.1:{self.ports['verifier']}") as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            while not stub.Stats(verifier_pb2.StatsRequest(), timeout=5.0).drafter_connected:
                if time.monotonic() > deadline:
                    log.warning("the verifier has not connected to its drafter after %.0f s: serving without drafts "
                                "until it does", timeout_s)
                    return
                time.sleep(0.1)

    def start(self) -> str:
        c = self.config
        common = ["--model", c.model, "--device", c.device, "--dtype", c.dtype]
        self.ports = {"verifier": free_port(), "gateway": c.port or free_port()}
        verifier = ["verifier", *common, "--port", str(self.ports["verifier"]), *c.verifier_args]
        names = ["verifier", "gateway"]
        try:
            if c.drafter != "none" and c.drafter_in_process:
                verifier += ["--in-process-drafter", c.drafter, "-k", str(c.num_drafts), *c.drafter_args]
            elif c.drafter != "none":
                self.ports["drafter"] = free_port()
                names.insert(0, "drafter")
                self._spawn("drafter", ["drafter", "--kind", c.drafter, "-k", str(c.num_drafts), *common,
                                        "--port", str(self.ports["drafter"]), *c.drafter_args])
                verifier += ["--drafter-address", f"127.0.0.1:{self.ports['drafter']}", "-k", str(c.num_drafts),
                             "--transport", c.transport]
            self._spawn("verifier", verifier)
            gateway = ["gateway", "--model", c.model, "--verifier-address", f"127.0.0.1:{self.ports['verifier']}",
                       "--host", c.gateway_host, "--port", str(self.ports["gateway"]), *c.gateway_args]
            if c.http_port is not None:
                self.ports["http"] = c.http_port or free_port()
                gateway += ["--http-port", str(self.ports["http"])]
            self._spawn("gateway", gateway)
            for name in names:
                self._wait_healthy(name)
            if "drafter" in self.procs:
                self._wait_drafter_link()
        except BaseException:  # Ctrl-C while loading included: nothing started may outlive us
            self.stop()
            raise
        self.address = f"{self.host_of('gateway')}:{self.ports['gateway']}"
        return self.address

    @property
    def http_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (…/v1), when the stack serves it."""
        scheme = "https" if self.config.gateway_tls else "http"
        return f"{scheme}://{self.host_of('http')}:{self.ports['http']}/v1" if "http" in self.ports else None

    def kill(self, name: str) -> None:
        """SIGKILL one service (fault tests)."""
        self.procs[name].kill()
        self.procs[name].wait()

    def restart(self, name: str, wait: bool = True) -> None:
        """Start `name` again with the same command and port (after it died or was killed)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running (pid {self.procs[name].pid})")
        self._spawn(name, self.commands[name])
        if wait:
            self._wait_healthy(name)

    def stop(self, grace_s: float = 10.0) -> None:
        for name in ("gateway", "verifier", "drafter"):  # front first: nothing new reaches the back
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", name, grace_s)
                p.kill()
                p.wait()
        self.procs.clear()


def run_stack(stack: LocalStack, body: Callable[[str], int]) -> int:
    """Start `stack`, return body(gateway address), and stop the stack whatever happens.

    SIGTERM and SIGHUP interrupt like Ctrl-C (KeyboardInterrupt: exit code 130), so the cleanup runs for them
    too; once it has begun, further signals are ignored until the children are gone."""
    stopping = False

    def interrupt(signum, frame):
        if not stopping:
            raise KeyboardInterrupt(signal.Signals(signum).name)
    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        return body(stack.start())
    except KeyboardInterrupt as e:
        print(f"stopping ({e or 'SIGINT'}) ...", file=sys.stderr, flush=True)
        return 130
    finally:
        stopping = True
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        try:
            stack.stop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
