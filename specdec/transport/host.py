"""This host: which one this process runs on (SHM and CUDA IPC need both peers on the same one), and a free local
port for a service (or a tensor-parallel group's store) it starts next."""
import random
import socket
from pathlib import Path


def host_id() -> str:
    """Equal in every process and container of one boot (the kernel's boot id), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a service this process starts next. Drawn below the kernel's
    ephemeral range and never one handed out before by this process: bind(0) picks from that range, where any
    process's outgoing connection can take the port before the service binds it (a test gateway's HTTP port was
    lost that way)."""
    low = ephemeral_port_floor()
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 16384), low)
        if port in _handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:   # nothing free below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_port_floor() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
