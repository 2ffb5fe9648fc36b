"""Directories written beside their final place and renamed into it when complete, and this
user's private directory in the temp dir.

A build writes `.NAME.partial-PID/` next to `NAME/` (packages, compile-cache entries) and
renames it into place at the end, so a reader never sees half a directory. A process killed
with SIGKILL cannot clean up after itself: the next writer removes every such directory whose
process is gone. SIGTERM (what `kill` and service managers send) becomes an exception while
writing, so `finally` blocks run and nothing is left in the first place.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from aotgen.recipe import ProjectError

_PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)$")


def partial_dir(final: Path) -> Path:
    """Where this process writes `final` before renaming it into place."""
    return final.with_name(f".{final.name}.partial-{os.getpid()}")


def old_dir(final: Path) -> Path:
    """Where this process moves the previous `final` while swapping in the new one."""
    return final.with_name(f".{final.name}.old-{os.getpid()}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(parent: Path) -> list[Path]:
    """Remove `.NAME.partial-PID` / `.NAME.old-PID` directories in `parent` whose process
    has ended; returns what was removed. Live writers' directories are left alone."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for path in parent.iterdir():
        m = _PARTIAL.match(path.name)
        if m and path.is_dir() and not path.is_symlink() and not _alive(int(m["pid"])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a directory was being written: handled like Ctrl-C (no
    `except Exception` swallows it, every `finally` runs)."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` (main thread only; elsewhere a no-op),
    so the writer's cleanup runs as it does for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def private_dir() -> Path:
    """`$TMPDIR/aotgen-UID`, this user's directory (mode 700) for what must not be planted or
    swapped by another user of the machine: the kernel libraries a build loads, the links
    through which the compiler reaches a cache. Refused if that path is anything else."""
    path = Path(tempfile.gettempdir()) / f"aotgen-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ProjectError(
            f"{path} is not a directory of this user's alone (mode 700, not a link): remove it, "
            "or set TMPDIR to a directory of your own"
        )
    return path
