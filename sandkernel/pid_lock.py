"""One process per file: an exclusive flock on a lock file that names its holder.

The session catalog and the audit stream each allow one writer (two gateways on one catalog
would adopt each other's sandboxes; two on one audit log would fork its hash chain). The lock
file is created 0600 and opened without following a link; it holds the holder's pid, so the
refusal can name it. The flock goes with the process, however it ends.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

MAX_PID_BYTES = 32


class LockHeldError(Exception):
    """Another process holds the lock; ``holder`` is the pid it wrote (or "unknown")."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"held by pid {holder}")
        self.holder = holder


def take_pid_lock(name: str | Path, dir_fd: int | None = None) -> int:
    """The fd of ``name`` (relative to ``dir_fd`` when given), exclusively flocked with this pid
    written in it: keep it open as long as the lock must hold. Raises LockHeldError (the fd is
    closed) when another process holds it; OSError when the file cannot be opened."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, MAX_PID_BYTES, 0).decode(errors="replace").strip() or "unknown"
            raise LockHeldError(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
