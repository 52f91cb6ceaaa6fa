"""Host uids for sandboxes: each sandbox gets one no other live sandbox on this host has.

Why a uid per sandbox: under runc, per-user kernel accounting (inotify instances and watches,
pipe buffers, RLIMIT_NPROC/MSGQUEUE, signal permission) is per host uid, so a shared uid would
let one sandbox exhaust or signal another. Why this range: ``useradd`` hands out subordinate
ids (``/etc/subuid``, ``/etc/subgid``) from 100000 in blocks of 65536, up to 600100000 by
default, and systemd gives containers 0x00080000-0x6FFFFFFF; a sandbox uid in any of those
could share accounting with a rootless container or a user namespace. 0x70000000-0x7FFDFFFF
is unused by both (below 2^31, which Docker, runc, gVisor and tmpfs ``uid=`` all accept), and
ranges the host's own subuid/subgid files list are skipped as well.

Uniqueness holds across threads, gateway restarts and concurrent processes on one host:
under an ``fcntl`` lock on ``<runtime base>/uids/.lock``, a uid is taken only if no container
carries it in its ``sandkernel.uid`` label (Docker is the source of truth for what runs) and
no live process holds a reservation file ``<runtime base>/uids/<uid>`` for it (which covers
the moment between allocation and container creation). A reservation names its owner
(:func:`~sandkernel.kernels.sandbox.labels.owner_label`); those of dead owners are dropped.

One exception, under gVisor only: a kernel restored from a memory checkpoint keeps the uid it was
saved with (its processes' credentials are part of the image), so a fork's children share their
parent's uid, and a resumed session takes its old uid back even if another sandbox took it
meanwhile. A gVisor sandbox's processes are the sentry's, not the host's: the per-user accounting
above does not apply to them, and the uid only names the owner of its own workspace disk's files.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from sandkernel.errors import SandkernelError
from sandkernel.kernels.sandbox.docker_engine import DockerEngine
from sandkernel.kernels.sandbox.labels import owner_alive, owner_label
from sandkernel.kernels.sandbox.runtime_dir import default_base_dir

SANDBOX_UID_RANGE = (0x7000_0000, 0x7FFE_0000)  # [low, high): 1879048192 to 2147352575
UID_LABEL = "sandkernel.uid"
SUBID_FILES = (Path("/etc/subuid"), Path("/etc/subgid"))
MAX_TRIES = 1000


def subid_ranges(files: Iterable[Path] = SUBID_FILES) -> list[tuple[int, int]]:
    """``[start, end)`` of every ``name:start:count`` line in the subordinate id files (missing
    files and malformed lines are skipped: they reserve nothing)."""
    ranges = []
    for path in files:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                ranges.append((int(parts[1]), int(parts[1]) + int(parts[2])))
    return ranges


def pick_uid(in_use: set[int], excluded: list[tuple[int, int]], uid_range: tuple[int, int] = SANDBOX_UID_RANGE) -> int:
    """A random uid of ``uid_range`` neither in ``in_use`` nor in any ``excluded`` range."""
    low, high = uid_range
    for _ in range(MAX_TRIES):
        uid = low + secrets.randbelow(high - low)
        if uid not in in_use and not any(start <= uid < end for start, end in excluded):
            return uid
    raise SandkernelError(
        f"no free sandbox uid in {low}-{high - 1} after {MAX_TRIES} tries (subuid ranges overlap it?)"
    )


class UidAllocator:
    """Allocates and releases sandbox uids for one host (see the module docstring).

    Blocking (a Docker call and a file lock): call from a thread.
    """

    def __init__(
        self,
        engine: DockerEngine,
        directory: Path | None = None,
        subid_files: Iterable[Path] = SUBID_FILES,
        uid_range: tuple[int, int] = SANDBOX_UID_RANGE,
    ) -> None:
        self.engine = engine
        self.directory = directory or default_base_dir() / "uids"
        self.subid_files = tuple(subid_files)
        self.uid_range = uid_range

    def labelled_uids(self) -> set[int]:
        """Uids on any container's ``sandkernel.uid`` label, running or not, whoever owns it."""
        uids = set()
        # The low-level list: one call, no per-container inspect to race with removals.
        for container in self.engine.client.api.containers(all=True, filters={"label": UID_LABEL}):
            value = (container.get("Labels") or {}).get(UID_LABEL, "")
            if value.isdigit():
                uids.add(int(value))
        return uids

    def reserved_uids(self) -> set[int]:
        """Uids reserved by live processes; reservations of dead owners are removed."""
        uids = set()
        for entry in os.scandir(self.directory):
            if not entry.name.isdigit():
                continue
            try:
                owner = Path(entry.path).read_text()
            except OSError:
                continue
            if owner_alive(owner):
                uids.add(int(entry.name))
            else:
                Path(entry.path).unlink(missing_ok=True)
        return uids

    def allocate(self) -> int:
        """Reserve and return a uid no live sandbox or reservation on this host has."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            in_use = self.reserved_uids() | self.labelled_uids()
            uid = pick_uid(in_use, subid_ranges(self.subid_files), self.uid_range)
            (self.directory / str(uid)).write_text(owner_label())
            return uid
        finally:
            os.close(fd)  # releases the lock

    def claim(self, uid: int) -> None:
        """Reserve ``uid`` for this process: a sandbox it re-adopted after a restart of the gateway
        (the reservation of the process that made it died with it)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            (self.directory / str(int(uid))).write_text(owner_label())
        finally:
            os.close(fd)

    def release(self, uid: int) -> None:
        """Drop this process's reservation (after the uid's container is removed)."""
        path = self.directory / str(int(uid))
        try:
            if path.read_text() == owner_label():
                path.unlink()
        except OSError:
            pass
