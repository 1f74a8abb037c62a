"""The three services as separate local processes on 127.0.0.1 (what `specdec serve` runs)."""
from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.rpc.health_probe import is_serving

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class StackConfig:
    model: str
    drafter: str = "mtp"              # a drafter kind (mtp | draft_model | ngram | synthetic | a plugin) or none
    num_drafts: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    port: int = 50051                 # the gateway's (0: any free port)
    transport: str = "auto"
    verifier_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()  # e.g. ("--draft-model", DIR) or ("--option", "KEY=VALUE")
    log_dir: str | None = None        # None: children log to this terminal
    startup_timeout_s: float = 600.0


@dataclass
class LocalStack:
    config: StackConfig
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    address: str = ""

    def _spawn(self, name: str, args: list[str]) -> None:
        out = None
        if self.config.log_dir:
            out = open(Path(self.config.log_dir) / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "specdec", *args]
        (log.debug if self.config.log_dir else log.info)("starting %s: %s", name, " ".join(cmd))
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                            start_new_session=True)

    def _wait_healthy(self, name: str, address: str) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not is_serving(address, timeout=1.0):
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with code {self.procs[name].returncode} while starting"
                                   + (f"; see {self.config.log_dir}/{name}.log" if self.config.log_dir else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} at {address} not healthy after {self.config.startup_timeout_s:.0f}s")
            time.sleep(0.2)

    def start(self) -> str:
        c = self.config
        common = ["--model", c.model, "--device", c.device, "--dtype", c.dtype]
        verifier_port, gateway_port = free_port(), c.port or free_port()
        self.ports = {"verifier": verifier_port, "gateway": gateway_port}
        verifier = ["verifier", *common, "--port", str(verifier_port), *c.verifier_args]
        if c.drafter != "none":
            drafter_port = self.ports["drafter"] = free_port()
            self._spawn("drafter", ["drafter", "--kind", c.drafter, "-k", str(c.num_drafts), *common,
                                    "--port", str(drafter_port), *c.drafter_args])
            verifier += ["--drafter-address", f"127.0.0.1:{drafter_port}", "-k", str(c.num_drafts),
                         "--transport", c.transport]
        self._spawn("verifier", verifier)
        self._spawn("gateway", ["gateway", "--model", c.model, "--verifier-address", f"127.0.0.1:{verifier_port}",
                                "--port", str(gateway_port)])
        try:
            if c.drafter != "none":
                self._wait_healthy("drafter", f"127.0.0.1:{drafter_port}")
            self._wait_healthy("verifier", f"127.0.0.1:{verifier_port}")
            self._wait_healthy("gateway", f"127.0.0.1:{gateway_port}")
        except Exception:
            self.stop()
            raise
        self.address = f"127.0.0.1:{gateway_port}"
        return self.address

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
