"""What of the swarm lab is alive on this machine, found from the kernel's own records (/proc,
/run/netns, the cgroup tree) rather than from the lab's bookkeeping, so that a crashed run's
leftovers are found as surely as this run's, and the teardown can prove it left nothing."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .commands import LabError

CGROUP_ROOT = Path("/sys/fs/cgroup")


def netns_inode(name: str) -> int | None:
    """The inode of a named network namespace (what /proc/PID/ns/net of its processes shows)."""
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def state(pid: int) -> str:
    """The process state letter (``R``, ``S``, ``Z`` ...), ``?`` if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def cmdline(pid: int) -> str:
    """The process's command line (first 200 characters), ``?`` if it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def cgroup_tops(name_glob: str) -> list[Path]:
    """Top cgroup directories matching ``name_glob`` (e.g. ``sklab-h*``), in every v1 hierarchy."""
    return sorted(p for p in CGROUP_ROOT.glob(f"*/{name_glob}") if p.is_dir())


def processes(netns: Iterable[str], marks: Sequence[str], cgroups: Iterable[Path]) -> set[int]:
    """Live processes (zombies excluded: already dead, their parent's to reap) that are in one of
    the named network namespaces, in one of the cgroup trees, or whose command line contains one
    of ``marks``. Never this process or its parent."""
    inodes = {ino for ino in map(netns_inode, netns) if ino is not None}
    me = {os.getpid(), os.getppid()}
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in me:
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino in inodes:
                found.add(int(entry.name))
                continue
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in line for mark in marks):
            found.add(int(entry.name))
    for top in cgroups:
        # os.walk, not rglob: a cgroup that goes while the tree is walked (its container just
        # died) is skipped instead of failing the walk.
        for folder, _, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in (Path(folder) / "cgroup.procs").read_text().split())
    return {pid for pid in found - me if state(pid) not in ("Z", "?")}


def kill_all(find: Callable[[], set[int]], timeout: float, reap: Callable[[], None] = lambda: None) -> None:
    """SIGKILL whatever ``find()`` returns until it returns nothing (a shim can fork a task while
    its siblings die); LabError naming the survivors after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while pids := find():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reap()
        if time.monotonic() > deadline:
            raise LabError(f"processes survive SIGKILL: {[(pid, cmdline(pid)) for pid in sorted(pids)]}")
        time.sleep(0.05)
    reap()


def remove_cgroups(tops: Iterable[Path], timeout: float = 15.0) -> None:
    """rmdir the cgroup trees, deepest first, each once it is empty.

    A cgroup whose processes were all SIGKILLed can stay busy for a while after its
    ``cgroup.procs`` reads empty: a dead task counts until its parent (here often PID 1, after
    its own parent died) reaps it, and ``cgroup.procs`` no longer lists it. So an EBUSY rmdir is
    tried again until ``timeout``; what still stands then is for :meth:`Lab.leftovers` to name
    (seen once in a rehearsal: every hierarchy's ``sklab-h1`` left, gone by the next lab)."""
    deadline = time.monotonic() + timeout
    for top in tops:
        subs = [Path(folder) for folder, _, _ in os.walk(top)]  # (tolerates vanishing dirs)
        for folder in sorted(subs, key=lambda p: len(p.parts), reverse=True):
            _rmdir_when_empty(folder, deadline)


def _rmdir_when_empty(folder: Path, deadline: float) -> None:
    while True:
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                return
        time.sleep(0.05)


def mount_points(marks: Sequence[str], *, everywhere: bool = True) -> list[str]:
    """Mount points starting with one of ``marks``, in every mount namespace of the machine (one
    /proc/PID/mountinfo read per namespace), or only in this process's with ``everywhere=False``."""
    entries: Iterable[Path] = Path("/proc").iterdir() if everywhere else [Path("/proc/self")]
    seen: set[int] = set()
    found: set[str] = set()
    for entry in entries:
        if not entry.name.isdigit() and entry.name != "self":
            continue
        try:
            ns = os.stat(entry / "ns" / "mnt").st_ino
            if ns in seen:
                continue
            seen.add(ns)
            text = (entry / "mountinfo").read_text()
        except OSError:
            continue
        found.update(point for point in (line.split()[4] for line in text.splitlines()) if point.startswith(tuple(marks)))
    return sorted(found)
