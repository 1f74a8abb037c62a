"""Which host this process runs on: SHM and CUDA IPC need both peers on the same one."""
import socket


def host_id() -> str:
    """Equal in every process and container of one boot (the kernel's boot id), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()
