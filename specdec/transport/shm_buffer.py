"""A shared-memory file on this host, mapped as a tensor by two processes: the SHM transport (CPU).

The verifier creates the file once (mode 0600, so only its own user can open it) and writes hidden states into it;
the drafter maps the same file by the path the verifier's Setup names. A writer never overwrites a region before
the reader has answered the step that used it (one step in flight).

Both sides map the file through the descriptor they opened, and a mapping outlives the file's name: once the
drafter has mapped a connection's files, the verifier unlinks them (verifier_service/drafter_link.py), so what
they carry (hidden states, a batch's token ids) is left in no file anyone could open later, and a verifier that is
killed leaves nothing behind from its mapped connections. Files of a process killed before that point are removed by
remove_stale_segments (at the verifier's start) or remove_segments_of (by a supervisor, for a child it saw die).

A drafter maps only what looks like a verifier's segment (attach): `<shm dir>/specdec-<pid>-<id>`, a regular
file (no symbolic link, FIFO or device), owned by the drafter's own user, of exactly the size the Setup says.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import tempfile
import uuid
from pathlib import Path

import torch

SEGMENT_PREFIX = "specdec"


def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _segment_name(prefix: str) -> re.Pattern:
    """`<prefix>-<pid>-<hex id>`, the names create() gives (group 1: the pid)."""
    return re.compile(rf"{re.escape(prefix)}-([0-9]+)-[0-9a-f]+")


class ShmBuffer:
    def __init__(self, path: Path, fd: int, size_bytes: int, owner: bool):
        """Map `size_bytes` of the open file `fd` (the caller closes fd; the mapping stays)."""
        self.path, self.size_bytes, self.owner = Path(path), size_bytes, owner
        self._map = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # [size], the mapping's own pages

    @staticmethod
    def create(size_bytes: int, prefix: str = SEGMENT_PREFIX) -> "ShmBuffer":
        """A new file of `size_bytes` zeros, readable and writable by this user only. O_EXCL | O_NOFOLLOW: a name
        planted in the shared directory (a symbolic link, a file of another user) is never opened."""
        path = _shm_dir() / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)   # exactly 0600 whatever the umask (which can only have taken bits away)
            os.ftruncate(fd, size_bytes)
            return ShmBuffer(path, fd, size_bytes, owner=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @staticmethod
    def attach(path: str, size_bytes: int, prefix: str = SEGMENT_PREFIX) -> "ShmBuffer":
        """Map a verifier's segment named by a Setup message. Raises ValueError (or FileNotFoundError) saying why
        `path` is refused, without blocking: see the module's docstring for what is accepted. The checks are made
        on the descriptor that is then mapped (fstat), so the file cannot be swapped after they passed."""
        shm_dir = _shm_dir()
        if size_bytes <= 0:
            raise ValueError(f"shared-memory file {path!r}: size_bytes must be positive, not {size_bytes}")
        inside = f"{shm_dir}/"   # then a name alone: no '..', no second '/', nothing but create()'s names
        if not path.startswith(inside) or not _segment_name(prefix).fullmatch(path[len(inside):]):
            raise ValueError(f"shared-memory file {path!r} is not a verifier's segment: only "
                             f"{shm_dir}/{prefix}-<pid>-<id> files are mapped")
        try:
            seen = os.lstat(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"shared-memory file {path} is missing (SHM needs both processes on the same "
                                    "host, sharing /dev/shm)") from None
        _check_segment(path, seen, size_bytes)   # before opening: a FIFO or a device is never opened
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:   # replaced by a symbolic link since the lstat
                raise ValueError(f"shared-memory file {path} is a symbolic link") from None
            raise
        try:
            _check_segment(path, os.fstat(fd), size_bytes)   # what is mapped: the file opened
            return ShmBuffer(Path(path), fd, size_bytes, owner=False)
        finally:
            os.close(fd)

    def view(self, offset_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if offset_bytes + n > self.size_bytes:
            raise ValueError(f"shm region [{offset_bytes}, {offset_bytes + n}) is past the buffer ({self.size_bytes})")
        return self.bytes[offset_bytes:offset_bytes + n].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file's name (the creator's; the mappings stay). Once the other side has mapped it, nothing
        else needs the name: no process can open it any more, and it cannot outlive both mappings."""
        if self.owner:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.unlink()


def _check_segment(path: str, st: os.stat_result, size_bytes: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"shared-memory file {path} is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"shared-memory file {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise ValueError(f"shared-memory file {path} is owned by uid {st.st_uid}, not by this process's "
                         f"{os.geteuid()}")
    if st.st_size != size_bytes:
        raise ValueError(f"shared-memory file {path} has {st.st_size} bytes, the setup says {size_bytes}")


def _alive(pid: int) -> bool:
    """A process `pid` exists in our PID namespace (a zombie not yet reaped counts: see remove_segments_of)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):   # (a pid past the C int range: none)
        return False
    except PermissionError:   # another user's process
        return True
    return True


def _remove_segments(prefix: str, keep) -> list[Path]:
    """Unlink this user's regular files `<shm dir>/<prefix>-<pid>-<id>` for which keep(pid) is false."""
    pattern, removed = _segment_name(prefix), []
    with os.scandir(_shm_dir()) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match is None or keep(int(match.group(1))):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
            except FileNotFoundError:   # its owner unlinked it meanwhile
                pass
    return removed


def remove_stale_segments(prefix: str = SEGMENT_PREFIX) -> list[Path]:
    """Unlink the segments of processes that are gone (this user's files only; the paths removed). A verifier
    killed before its drafter mapped its buffers leaves them behind: the verifier calls this as it starts.

    Liveness is seen in this PID namespace: processes that share the shm directory from another PID namespace
    (containers sharing only IPC) must not share a user either, or a live one's unmapped segment may go (its
    drafter then refuses that Setup and the verifier reconnects with new files)."""
    return _remove_segments(prefix, keep=lambda pid: pid <= 0 or pid == os.getpid() or _alive(pid))


def remove_segments_of(pid: int) -> list[Path]:
    """Unlink the segments process `pid` created (this user's files only; the paths removed), for a supervisor
    that saw its child `pid` die: unlike remove_stale_segments, it does not ask whether `pid` still exists (a
    child not yet reaped does)."""
    return _remove_segments(SEGMENT_PREFIX, keep=lambda p: p != pid)
