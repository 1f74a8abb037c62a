"""The training corpus: the running interpreter's own standard-library sources.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]`, in sorted order, except
  - anything inside a folder named `test`, `tests`, `idle_test` (idlelib/idle_test; lib2to3/tests is a
    `tests` folder), `site-packages` or `__pycache__`,
  - files larger than MAX_FILE_BYTES (a few generated tables such as pydoc_data/topics.py),
  - symlinks leading out of the stdlib folder (e.g. Debian's sitecustomize.py -> /etc/python3.X/).

A fixed evaluation set is held out: the files whose path relative to the stdlib root is in HELD_OUT
(modules present in CPython 3.11 and 3.12; any that a given interpreter lacks are skipped). Everything
else is training data, so the two sets are disjoint by construction.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

MAX_FILE_BYTES = 200_000
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})

# The held-out evaluation files (paths relative to the stdlib root, "/"-separated). Chosen to span
# parsing, numerics, text processing, data structures and I/O helpers; all are plain-Python modules.
HELD_OUT: tuple[str, ...] = (
    "bisect.py",
    "calendar.py",
    "colorsys.py",
    "csv.py",
    "difflib.py",
    "fnmatch.py",
    "fractions.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "html/parser.py",
    "ipaddress.py",
    "json/decoder.py",
    "netrc.py",
    "numbers.py",
    "operator.py",
    "pprint.py",
    "quopri.py",
    "sched.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "uu.py",      # removed in 3.13; skipped where missing
    "wave.py",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def relative_name(path: Path, root: Path | None = None) -> str:
    """`path` (as listed by all_files) relative to the stdlib root, "/"-separated (the form HELD_OUT uses)."""
    return Path(path).relative_to(root or stdlib_root()).as_posix()


def is_excluded(rel: str, size: int) -> bool:
    folders = rel.split("/")[:-1]
    return size > MAX_FILE_BYTES or any(part in EXCLUDED_DIRS for part in folders)


def all_files(root: Path | None = None) -> list[Path]:
    """Every eligible stdlib source file (training and held-out), sorted by relative path."""
    root = root or stdlib_root()
    found = []
    for path in root.rglob("*.py"):
        if not path.is_file() or not path.resolve().is_relative_to(root.resolve()):
            continue
        rel = path.relative_to(root).as_posix()
        if not is_excluded(rel, path.stat().st_size):
            found.append((rel, path))
    return [path for _, path in sorted(found)]


def held_out_files(root: Path | None = None) -> list[Path]:
    """The HELD_OUT files this interpreter has, in HELD_OUT order (missing ones are skipped)."""
    root = root or stdlib_root()
    eligible = {p.relative_to(root).as_posix(): p for p in all_files(root)}
    return [eligible[name] for name in HELD_OUT if name in eligible]


def training_files(root: Path | None = None) -> list[Path]:
    """All eligible files except the held-out ones, sorted."""
    root = root or stdlib_root()
    held = set(HELD_OUT)
    return [p for p in all_files(root) if p.relative_to(root).as_posix() not in held]


def spread(files: list[Path], limit: int | None) -> list[Path]:
    """At most `limit` of `files`, evenly spaced through the sorted list (all of them when limit is None)."""
    if limit is None or limit >= len(files):
        return list(files)
    if limit <= 0:
        raise ValueError(f"file limit must be positive, not {limit}")
    return [files[i * len(files) // limit] for i in range(limit)]


def read_text(path: str | Path) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")
