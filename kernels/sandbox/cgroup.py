"""A sandbox's cgroup, read from the host: CPU time and peak memory over one cell.

Docker puts each container in a cgroup named after its full id: ``<controller>/docker/<id>``
(driver cgroupfs; ``/docker`` is the engine's default parent, another when dockerd was started
with ``--cgroup-parent``: :func:`use_engine_parent`) or ``.../system.slice/docker-<id>.scope``
(driver systemd), under cgroup v1 (one hierarchy per controller: ``cpuacct``, ``memory``) or v2
(one unified directory). Under gVisor the same cgroup holds the sandbox's host side (the Sentry,
the gofer, the ptrace stubs), so it counts everything the sandbox costs the host, guest work and
gVisor's own overhead alike (checked on this project's host: a 1.5 s busy loop plus a 300 MB
allocation moved runsc's ``cpuacct.usage`` by 1.8 s and ``memory.max_usage_in_bytes`` to 378
MB).

Peak memory over a cell, not over the container's life:
- v1: ``memory.max_usage_in_bytes`` is reset (write ``0``) when the cell starts and read at its end.
- v2: ``memory.peak`` is reset per open file (kernel >= 6.12: a write to an fd resets the peak
  seen through that fd, and no one else's); on older kernels it is the cgroup's lifetime peak,
  which is the cell's when it rose during the cell, and otherwise the cell's peak is unknown
  and ``memory.current`` sampled at both ends stands in (said in a note).
Both count what the cgroup charges: the page cache of files written is included.

Everything here is blocking sysfs I/O of a few microseconds, and only of paths built from a
container id checked to be 64 hex digits: nothing the sandbox writes is read.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
TENANT_GROUPS = "sandkernel-tenant-*"  # tenants' CPU groups (cpu_groups.py), parents of their sandboxes
DEFAULT_ENGINE_PARENT = "/docker"  # where Docker's cgroupfs driver puts containers unless told otherwise
_ENGINE_PARENT = re.compile(r"(/[A-Za-z0-9_.:@-]+)+")
_engine_parent = DEFAULT_ENGINE_PARENT
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_MAX_READ = 4096  # every file read here is a few lines; a longer one is not what we expect


def check_engine_parent(parent: str) -> str:
    """``parent`` if it can be the Docker engine's cgroup parent (an absolute cgroup path of plain
    names, no ``.`` or ``..`` step: it becomes part of paths under /sys/fs/cgroup), else ValueError."""
    steps = parent.split("/")[1:] if isinstance(parent, str) else []
    if not isinstance(parent, str) or not _ENGINE_PARENT.fullmatch(parent) or {".", ".."} & set(steps):
        raise ValueError(
            f"the engine's cgroup parent is an absolute cgroup path such as {DEFAULT_ENGINE_PARENT}, not {parent!r}"
        )
    return parent


def use_engine_parent(parent: str) -> str:
    """Tell this process where the Docker engine puts its containers' cgroups (dockerd's
    ``--cgroup-parent``; :data:`DEFAULT_ENGINE_PARENT` when it has none): the tenants' CPU groups
    are made there, and sandboxes' cgroups are looked for there. Returns the choice it replaces,
    for an in-process gateway that stops to put back."""
    global _engine_parent
    previous, _engine_parent = _engine_parent, check_engine_parent(parent)
    return previous


def engine_parent() -> str:
    """The Docker engine's cgroup parent (see :func:`use_engine_parent`), e.g. ``/docker``."""
    return _engine_parent


def tenant_groups_parent() -> str:
    """Where the tenants' CPU groups are made (cpu_groups.py): at the root of the hierarchy (``""``)
    beside Docker's own ``/docker`` when the engine keeps Docker's default parent, so that each
    tenant is an entity of its own at the top and a kernel waking in a quiet tenant's group is not
    queued behind a busy tenant's under a shared ``/docker``; inside the engine's parent when the
    operator gave it one, so that sandboxes stay inside what the operator gave the engine."""
    return "" if _engine_parent == DEFAULT_ENGINE_PARENT else _engine_parent


def tenant_group_parents() -> tuple[str, ...]:
    """Every place a tenant's group may be, relative to a hierarchy's root: where they are made
    now, and under the engine's parent, where earlier gateways made them (their sandboxes are
    adopted, and those groups removed once empty)."""
    return tuple(dict.fromkeys((tenant_groups_parent().lstrip("/"), _engine_parent.lstrip("/"))))


APPROXIMATE_PEAK = (
    "peak memory is approximate (memory in use at the cell's start and end): this kernel cannot reset memory.peak"
)


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU time of a cgroup, in seconds (user and system may be None: not exposed)."""

    total: float
    user: float | None
    system: float | None

    def since(self, earlier: CpuTimes) -> CpuTimes:
        """The time spent between ``earlier`` and this reading (never negative).

        The total is exact (the scheduler's runtime), but the kernel splits it into user and
        system by sampling (per tick, or per charge), so the raw split neither sums to the total
        nor is exact over a short cell (measured here: a 1.25 s runsc cell split as 0.98 s). The
        split reported is the sampled proportion applied to the exact total, so user + system ==
        total; None when no sample fell in the interval (a cell shorter than a tick)."""
        total = round(max(self.total - earlier.total, 0.0), 6)
        if None in (self.user, self.system, earlier.user, earlier.system):
            return CpuTimes(total, None, None)
        user = max(self.user - earlier.user, 0.0)  # type: ignore[operator]
        system = max(self.system - earlier.system, 0.0)  # type: ignore[operator]
        if user + system <= 0:
            return CpuTimes(total, None, None)
        share = round(total * user / (user + system), 6)
        return CpuTimes(total, share, round(total - share, 6))


def _read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, _MAX_READ).decode("ascii", "replace")
    finally:
        os.close(fd)


def _read_int(path: Path) -> int:
    return int(_read(path).strip())


def _keyed(text: str) -> dict[str, int]:
    """``key value`` lines (cpu.stat, cpuacct.stat) as a dict; lines that are not are skipped."""
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return values


class _KeptFiles:
    """Cgroup files kept open and re-read with ``pread`` at offset 0, which makes the kernel
    generate the file afresh. Measured here: ~1 µs a read, against ~6 µs plus a path walk
    for open, read and close; a cell reads four or five of them twice. An fd that fails (the
    cgroup was removed: ENODEV) is closed, and the next read opens the file again. Once
    :meth:`close` was called, files are opened for each read and closed right after."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._closed = False

    def _fd(self, path: str, writable: bool) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
            self._fds[path] = fd
        return fd

    def read(self, path: str, writable: bool = False) -> str:
        try:
            return os.pread(self._fd(path, writable), _MAX_READ, 0).decode("ascii", "replace")
        except OSError:
            self._drop(path)
            raise
        finally:
            if self._closed:
                self._drop(path)

    def read_int(self, path: str, writable: bool = False) -> int:
        return int(self.read(path, writable).strip())

    def write(self, path: str, data: bytes) -> None:
        """Write through the fd :meth:`read` uses (opened read-write: the file is read back)."""
        try:
            os.pwrite(self._fd(path, True), data, 0)
        except OSError:
            self._drop(path)
            raise
        finally:
            if self._closed:
                self._drop(path)

    def _drop(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        self._closed = True
        for path in list(self._fds):
            self._drop(path)


class PeakWindow:
    """The peak memory of one cell: opened when the cell starts, read (then closed) at its end."""

    def peak(self) -> tuple[int, str | None]:
        """The peak in bytes and a note when it is an approximation. Raises OSError/ValueError."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the window holds (an open fd); safe to call twice."""


class CgroupV1:
    """A container's cgroup on a v1 host: ``cpuacct`` and ``memory`` hierarchies. The files a
    cell reads are kept open (:class:`_KeptFiles`) until :meth:`close`."""

    version = 1

    def __init__(self, cpuacct: Path, memory: Path) -> None:
        self.cpuacct = cpuacct
        self.memory = memory
        self._files = _KeptFiles()
        # Joined once: a pathlib join costs more than the read it names.
        self._usage, self._user, self._sys = (
            str(cpuacct / name) for name in ("cpuacct.usage", "cpuacct.usage_user", "cpuacct.usage_sys")
        )
        self._max_usage = str(memory / "memory.max_usage_in_bytes")

    def __repr__(self) -> str:
        return f"CgroupV1({self.cpuacct}, {self.memory})"

    def cpu_times(self) -> CpuTimes:
        """``cpuacct.usage`` (ns), with ``usage_user``/``usage_sys`` (ns) or else ``cpuacct.stat``
        (USER_HZ ticks) for the split. Raises OSError/ValueError when it cannot be read."""
        total = self._files.read_int(self._usage) / 1e9
        try:
            user = self._files.read_int(self._user) / 1e9
            system = self._files.read_int(self._sys) / 1e9
        except (OSError, ValueError):
            ticks = _keyed(_read(self.cpuacct / "cpuacct.stat"))
            hz = os.sysconf("SC_CLK_TCK")
            user = ticks["user"] / hz if "user" in ticks else None
            system = ticks["system"] / hz if "system" in ticks else None
        return CpuTimes(total, user, system)

    def open_peak(self) -> PeakWindow:
        return _V1Peak(self._files, self._max_usage)

    def close(self) -> None:
        """Close the files kept open; safe to call twice (a later read opens and closes its file)."""
        self._files.close()


class _V1Peak(PeakWindow):
    def __init__(self, files: _KeptFiles, path: str) -> None:
        self._files, self._path = files, path
        files.write(path, b"0")  # resets the high-water mark to the current usage

    def peak(self) -> tuple[int, str | None]:
        return self._files.read_int(self._path, writable=True), None


class CgroupV2:
    """A container's cgroup on a v2 host: one directory with ``cpu.stat`` and ``memory.*``.

    ``per_fd_peak``: whether ``memory.peak`` may be reset per fd; None tries it (an older kernel
    refuses the open for writing), False forces the fallback (tests of a pre-6.12 kernel)."""

    version = 2

    def __init__(self, path: Path, per_fd_peak: bool | None = None) -> None:
        self.path = path
        self.per_fd_peak = per_fd_peak
        self._files = _KeptFiles()
        self._stat = str(path / "cpu.stat")

    def __repr__(self) -> str:
        return f"CgroupV2({self.path})"

    def close(self) -> None:
        """Close the files kept open; safe to call twice (a later read opens and closes its file)."""
        self._files.close()

    def cpu_times(self) -> CpuTimes:
        """``cpu.stat``'s usage_usec, user_usec and system_usec (µs)."""
        stat = _keyed(self._files.read(self._stat))
        user, system = stat.get("user_usec"), stat.get("system_usec")
        return CpuTimes(
            stat["usage_usec"] / 1e6, None if user is None else user / 1e6, None if system is None else system / 1e6
        )

    def open_peak(self) -> PeakWindow:
        if self.per_fd_peak is not False:
            try:
                return _V2FdPeak(self.path / "memory.peak")
            except OSError:
                if self.per_fd_peak:
                    raise
        return _V2LifetimePeak(self.path)


class _V2FdPeak(PeakWindow):
    def __init__(self, file: Path) -> None:
        self._fd: int | None = os.open(file, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.write(self._fd, b"reset\n")  # kernel >= 6.12: the peak seen through this fd restarts now
        except OSError:
            self.close()
            raise

    def peak(self) -> tuple[int, str | None]:
        if self._fd is None:
            raise OSError("the memory.peak window is closed")
        return int(os.pread(self._fd, 64, 0).decode("ascii").strip()), None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _V2LifetimePeak(PeakWindow):
    def __init__(self, path: Path) -> None:
        self._path = path
        self._peak_before = _read_int(path / "memory.peak")
        self._current_before = _read_int(path / "memory.current")

    def peak(self) -> tuple[int, str | None]:
        peak = _read_int(self._path / "memory.peak")
        if peak > self._peak_before:
            return peak, None  # the container's high-water mark was set during this cell
        current = max(self._current_before, _read_int(self._path / "memory.current"))
        return current, APPROXIMATE_PEAK


Cgroup = CgroupV1 | CgroupV2


def locate(container_id: str, root: Path = CGROUP_ROOT) -> Cgroup | None:
    """The cgroup Docker made for ``container_id`` (its full id): at the places Docker's
    cgroupfs (under :func:`engine_parent`) and systemd drivers use, or in a tenant's CPU group
    (cpu_groups.py); None for a container given a parent of its own, or one that is gone. v2 when
    ``root/cgroup.controllers`` exists (a hybrid host's ``unified`` mount holds no cpu or
    memory controller, so v1 is read there)."""
    if not _CONTAINER_ID.fullmatch(container_id):
        return None
    parent = engine_parent().lstrip("/")
    tails = [Path(parent) / container_id, Path("system.slice") / f"docker-{container_id}.scope"]
    grouped = [Path(place) / TENANT_GROUPS / container_id for place in tenant_group_parents()]
    if (root / "cgroup.controllers").exists():
        tails += [path.relative_to(root) for pattern in grouped for path in root.glob(str(pattern))]
        for tail in tails:
            if (root / tail / "cpu.stat").exists():
                return CgroupV2(root / tail)
        return None
    tails += [
        path.relative_to(root / "cpuacct") for pattern in grouped for path in (root / "cpuacct").glob(str(pattern))
    ]
    for tail in tails:
        cpuacct, memory = root / "cpuacct" / tail, root / "memory" / tail
        if (cpuacct / "cpuacct.usage").exists() and (memory / "memory.max_usage_in_bytes").exists():
            return CgroupV1(cpuacct, memory)
    return None


def oom_kills(cgroup: Cgroup) -> int | None:
    """How many processes the cgroup's OOM killer ended (v1 ``memory.oom_control``, v2
    ``memory.events``); None when unreadable."""
    path = cgroup.memory / "memory.oom_control" if isinstance(cgroup, CgroupV1) else cgroup.path / "memory.events"
    try:
        return _keyed(_read(path)).get("oom_kill")
    except OSError:
        return None


def container_oom_kills(container_id: str, root: Path = CGROUP_ROOT) -> int | None:
    """:func:`oom_kills` of the cgroup of ``container_id`` (its full id); None when there is
    none (the container is gone) or it cannot be read. Blocking (sysfs stats and a read)."""
    found = locate(container_id, root)
    return None if found is None else oom_kills(found)


# The name runc gives its init while it sets up an exec (before it runs the program).
RUNC_INIT_COMM = "runc:[2:INIT]"
_MAX_PROCS_READ = 1024 * 1024  # a cgroup.procs of up to ~100,000 pids


def kill_stopped_runc_inits(container_id: str, root: Path = CGROUP_ROOT) -> int:
    """SIGKILL the processes in the container's cgroup that are runc's init for an exec and are
    stopped. The sandbox's code runs as the uid an exec takes before it runs its program, so it
    can stop an exec there; ``runc exec`` then waits for it, and dockerd with it, holding the
    container's lock: every later exec, kill and removal of that container waits too. Each pid
    is checked through a pidfd (no pid reused meanwhile is hit) to still be in this cgroup, named
    runc's init and stopped. A process of the sandbox's that took that name is the sandbox's own
    to lose. Returns how many were killed; 0 where the cgroup or /proc cannot be read (a gateway
    in another pid namespace)."""
    found = locate(container_id, root)
    if found is None:
        return 0
    procs = (found.path if isinstance(found, CgroupV2) else found.memory) / "cgroup.procs"
    try:
        fd = os.open(procs, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pids = [int(line) for line in os.read(fd, _MAX_PROCS_READ).split() if line.isdigit()]
        finally:
            os.close(fd)
    except OSError:
        return 0
    killed = 0
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone
        try:
            if _stopped_runc_init(pid, container_id):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                killed += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    if killed:
        log.warning(
            "killed %d exec(s) the sandbox stopped before they ran", killed, extra={"container": container_id[:12]}
        )
    return killed


def _stopped_runc_init(pid: int, container_id: str) -> bool:
    """Whether ``pid`` (held by a pidfd) is runc's init, stopped, in ``container_id``'s cgroup."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    name, _, rest = stat[stat.find("(") + 1 :].rpartition(")")
    state = rest.split()[0] if rest.split() else ""
    return name == RUNC_INIT_COMM and state in ("T", "t") and container_id in _read(Path(f"/proc/{pid}/cgroup"))
