"""The labels every sandkernel container carries, and the owner label of this process.

Every container is labelled with its session (``sandkernel.session``), its kernel, the process
that owns it (host, pid and start time: a reused pid does not match) and its runtime dir. Labels
are data anyone with Docker access can write, so :func:`own_runtime_dir` accepts only a path that
is literally one of this process's runtime dirs. The reaper (kernels/lifecycle/reaper.py) and
adoption (kernels/execution/adoption.py) read them; the container and provisioner write them.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from functools import cache
from pathlib import Path

from sandkernel.kernels.sandbox.runtime_dir import RUNTIME_DIR_NAME, default_base_dir

SESSION_LABEL = "sandkernel.session"
KERNEL_LABEL = "sandkernel.kernel"
OWNER_LABEL = "sandkernel.owner"
RUNTIME_DIR_LABEL = "sandkernel.runtime_dir"


def process_start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot) from /proc, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


@cache
def owner_label() -> str:
    """This process's identity: host, pid and start time (a reused pid does not match)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{process_start_time(pid)}"


def owner_alive(label: str) -> bool:
    """Whether the process named by an owner label still runs (other hosts count as alive)."""
    try:
        host, pid, start = label.rsplit(":", 2)
        pid_num = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    return process_start_time(pid_num) == start


def own_runtime_dir(label: str, base: Path | None = None) -> Path | None:
    """The runtime dir a container's label names, if it is one of ours; else None.

    Labels are data anyone with Docker access can write (``sandkernel.runtime_dir=/etc``), so
    only a path that is literally ``<base>/<12 hex digits>`` is accepted (no ``..``, no other
    level), the base being this process's :func:`default_base_dir`, and both must be real
    directories, checked with lstat (a symlink is never followed) and owned by this user.
    """
    base = base or default_base_dir()
    path = Path(label)
    if not label or os.path.normpath(label) != label or path.parent != base:
        return None
    if not re.fullmatch(RUNTIME_DIR_NAME, path.name):
        return None
    for candidate in (base, path):
        try:
            st = os.lstat(candidate)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
    return path
