"""Per-cell accounting: what one execution cost the host and what it changed.

The session calls :meth:`CellMeter.start` right before it sends a cell and
:meth:`CellMeter.finish` once the cell ended (the timeout ladder included); the dict finish
returns rides on the result (``ExecutionResult.accounting``) into the transcript, the session
API and the audit log::

    {"wall_seconds", "cpu_seconds", "cpu_user_seconds", "cpu_system_seconds", "peak_memory_bytes",
     "files": {"created": [{"path", "size", "sha256"}], "modified": [...], "deleted": [{"path"}],
               "hashed": n, "unhashed": n, "omitted": n} | null,
     "egress": {"allowed": n, "refused": n, "failed": n} | null,
     "packages": {"installed": ["name==version"], "removed": [...]} | null,
     "notes": [str]}

Sources: the sandbox's cgroup (kernels/sandbox/cgroup.py: CPU as a delta, peak memory reset at
the start), the workspace disk's host mount (kernels/sandbox/workspace_scan.py: snapshots
before and after, hashed where they differ; kernels/sandbox/fs_changes.py: a fanotify flag that
says whether a snapshot is due at all), the session's egress proxy records. Accounting never
breaks an execution: a part that cannot be measured is null and ``notes`` says why.
Walks and hashing run in a worker thread, and only when something changed or opened a file in
the workspace; cgroup files (kept open, microseconds), the fanotify queue (drained without
blocking) and the egress records (appended on the loop by the proxy) are read on the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sandkernel.kernels.execution.events import Observers, SessionObserver
from sandkernel.kernels.model.profiles import Profile, WorkspaceStorage
from sandkernel.kernels.sandbox import workspace_scan
from sandkernel.kernels.sandbox.cgroup import Cgroup, CpuTimes, PeakWindow, locate
from sandkernel.kernels.sandbox.fs_changes import ChangeWatch, Unavailable

if TYPE_CHECKING:
    from sandkernel.kernels.egress.proxy import EgressProxy, EgressRecord
    from sandkernel.kernels.sandbox.container import SandboxContainer
    from sandkernel.kernels.sandbox.provisioner import DockerProvisioner

log = logging.getLogger(__name__)

MEMORY_WORKSPACE = "the workspace is in memory (tmpfs), which the host does not scan: files and packages are not known"
NOT_WATCHED = (
    "the workspace's changes cannot be watched ({reason}): it is walked after every cell, and a change "
    "made between cells counts in the next cell"
)


@dataclass
class _Cell:
    """What :meth:`CellMeter.start` saw, for :meth:`CellMeter.finish` to compare with."""

    container_id: str | None = None
    cgroup: Cgroup | None = None
    cpu: CpuTimes | None = None
    peak: PeakWindow | None = None
    mount: Path | None = None
    files: workspace_scan.Snapshot | None = None
    watched: bool = False  # the watch was asked at start: finish may ask it whether to walk
    proxy: EgressProxy | None = None
    last_record: EgressRecord | None = None
    seen_records: int = 0
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.peak is not None:
            self.peak.close()
            self.peak = None


class MeteredSession(Protocol):
    """What a meter reads of its session: kernels/execution/session.py's KernelSession, which
    creates the meter (so this module names it by what it reads, and imports nothing of it). The
    container and the provisioner are read each time: a restart replaces them."""

    @property
    def id(self) -> str: ...

    @property
    def profile(self) -> Profile: ...

    @property
    def container(self) -> SandboxContainer: ...

    @property
    def provisioner(self) -> DockerProvisioner: ...

    @property
    def observers(self) -> Observers: ...


class CellMeter:
    """Measures one cell at a time for a :class:`KernelSession` (created by the session, called
    under its execute lock). The container can be replaced between cells and within one: its id
    is read at every call, and its cgroup is looked up once per id.

    Files: a cell is compared with a snapshot of the workspace taken before it (the baseline).
    A fanotify watch on the workspace's filesystem (:class:`ChangeWatch`, opened at the first
    cell) says whether anything changed since the meter last looked, so the workspace is walked
    only when it did: ``start`` reuses the previous cell's closing snapshot when nothing changed
    between cells, and walks for a fresh baseline when something did (a change made between
    cells, by the kernel's background work or the files API, is charged to no cell); ``finish``
    walks, diffs and hashes only when something changed during the cell. Opening a file counts
    as a change (a store through a memory mapping makes no event, its open does), so a cell that
    reads workspace files is walked too; a cell that touches none costs a few reads on the loop
    and no thread. :attr:`walks` counts the snapshots taken.

    Without a watch (fanotify refused: not root, an old kernel; said once in ``notes``) the meter
    walks after every cell and reuses that snapshot as the next baseline: a change made between
    cells then counts in the next cell. A writer the meter does not see (the files API, an
    upload) may call :meth:`forget_files`: the next ``start`` walks the workspace first.
    ``fresh_baseline=True`` walks at every start whatever the watch says; ``watch=False`` never
    opens one (the behaviour without fanotify, for comparison: bench/accounting_overhead.py).

    The watch's fd and the cgroup files kept open live as long as the session: :meth:`close`
    (idempotent) releases them, and is called when the session closes (from its first cell on,
    the meter observes ``session_closed``)."""

    def __init__(self, session: MeteredSession, fresh_baseline: bool = False, watch: bool = True) -> None:
        self._session = session
        self._fresh_baseline = fresh_baseline
        self._use_watch = watch
        self._cgroups: dict[str, Cgroup | None] = {}
        self._cell: _Cell | None = None
        self._baseline: tuple[Path, workspace_scan.Snapshot] | None = None
        self._watch: ChangeWatch | None = None
        self._unwatched: str | None = None  # why the workspace cannot be watched (noted once)
        self._observing = False
        self._closed = False
        self.walks = 0  # workspace snapshots taken: a cell that changed nothing adds none

    @property
    def watching(self) -> bool:
        """Whether a fanotify watch currently tells this meter when the workspace changed."""
        return self._watch is not None and not self._watch.closed

    def forget_files(self) -> None:
        """The workspace was changed by something other than a cell (the files API, an
        upload): the next cell's ``start`` takes a fresh snapshot rather than reuse the last."""
        self._baseline = None

    def close(self) -> None:
        """Release the watch (its fanotify fd) for good, and the cgroup files kept open; the meter
        then walks every cell, like a meter without a watch. Called when the session closes;
        safe to call twice."""
        self._closed = True
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._baseline = None
        self._forget_cgroups()

    # -- what to measure, read from the session each time -----------------------------------

    def _container(self) -> tuple[str | None, Path | None, str | None]:
        """The container's id, the workspace's host mount, and a note when either is unknown."""
        try:
            container = self._session.container
        except Exception as err:  # no container (shut down, being replaced)
            return None, None, f"no container to measure ({type(err).__name__})"
        if self._session.profile.workspace_storage is not WorkspaceStorage.DISK:
            return container.id, None, MEMORY_WORKSPACE
        return container.id, container.spec.workspace_mount, None

    def _proxy(self) -> EgressProxy | None:
        try:
            return self._session.provisioner.egress
        except Exception:
            return None

    def _cgroup(self, container_id: str) -> Cgroup | None:
        """The cgroup of ``container_id``, looked up once (a few sysfs stats). After :meth:`close`
        (a cell that ends as the session closes) it is looked up again, and keeps nothing open."""
        if self._closed:
            found = locate(container_id)
            if found is not None:
                found.close()
            return found
        if container_id not in self._cgroups:
            self._forget_cgroups()  # one container at a time: a replaced one is not read again
            self._cgroups[container_id] = locate(container_id)
        return self._cgroups[container_id]

    def _forget_cgroups(self) -> None:
        for found in self._cgroups.values():
            if found is not None:
                found.close()  # the files it kept open
        self._cgroups.clear()

    def _changed(self, mount: Path, cell: _Cell) -> bool | None:
        """Whether the workspace at ``mount`` changed since the last call: True, False, or None
        when no watch can tell (then the caller walks as a meter without one). Drains the watch's
        queue on the loop (microseconds); opens the watch on first use (True: nothing is known
        from before it)."""
        watch = self._watch
        if watch is not None and watch.mount != mount:  # another mount point: not the one watched
            watch.close()
            watch = self._watch = None
        if watch is None:
            if self._closed or not self._use_watch or self._unwatched is not None:
                return None
            try:
                self._watch = ChangeWatch(mount)
            except (Unavailable, OSError) as err:
                self._unwatched = str(err)
                cell.notes.append(NOT_WATCHED.format(reason=self._unwatched))
                log.info("workspace not watched: %s", err, extra={"session": self._session.id})
                return None
            return True
        try:
            return watch.changed()
        except (Unavailable, OSError) as err:  # unmounted or remounted: a new watch next time
            log.info("workspace watch ended: %s", err, extra={"session": self._session.id})
            watch.close()
            self._watch = None
            return True

    def _close_with_session(self) -> None:
        if not self._observing:
            self._observing = True
            self._session.observers.add(_CloseWithSession(self))

    def _snapshot(self, mount: Path) -> workspace_scan.Snapshot:
        self.walks += 1
        return workspace_scan.snapshot(mount)

    # -- start --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take the cell's starting point (cgroup counters, peak reset, workspace baseline,
        egress mark). Never raises: what cannot be read is left out and noted."""
        if self._cell is not None:
            self._cell.close()  # a finish that never came
        cell = _Cell()
        self._cell = cell
        try:
            self._close_with_session()
            container_id, mount, note = self._container()
            if note:
                cell.notes.append(note)
            cell.container_id, cell.mount = container_id, mount
            cell.proxy = self._proxy()
            if cell.proxy is not None:
                cell.seen_records = len(cell.proxy.records)
                cell.last_record = cell.proxy.records[-1] if cell.proxy.records else None
            baseline, self._baseline = self._baseline, None
            if mount is not None:
                # Asked before any walk: a change after this point is in the walk or in the queue.
                changed = self._changed(mount, cell)
                cell.watched = changed is not None
                if baseline is not None and baseline[0] == mount and not changed and not self._fresh_baseline:
                    cell.files = baseline[1]
                else:
                    cell.files = await asyncio.to_thread(self._start_files, mount, cell)
            self._start_cgroup(cell)  # sysfs reads of a few microseconds, right before the cell is sent
        except Exception as err:
            log.warning("accounting could not start: %s", err, exc_info=True, extra={"session": self._session.id})
            cell.notes.append(f"accounting could not start: {type(err).__name__}")

    def _start_cgroup(self, cell: _Cell) -> None:
        if cell.container_id is None:
            return
        cell.cgroup = self._cgroup(cell.container_id)
        if cell.cgroup is None:
            cell.notes.append("the container's cgroup was not found: CPU and memory are not known")
            return
        try:
            cell.cpu = cell.cgroup.cpu_times()
            cell.peak = cell.cgroup.open_peak()
        except (OSError, ValueError, KeyError) as err:
            cell.notes.append(f"the container's cgroup could not be read ({type(err).__name__})")

    def _start_files(self, mount: Path, cell: _Cell) -> workspace_scan.Snapshot | None:
        try:
            return self._snapshot(mount)
        except OSError as err:
            cell.notes.append(f"the workspace could not be scanned ({err.strerror or type(err).__name__})")
            return None

    # -- finish -------------------------------------------------------------------------------

    async def finish(self, wall_seconds: float) -> dict[str, Any]:
        """The cell's accounting (the dict of the module docstring). Never raises."""
        cell, self._cell = self._cell, None
        if cell is None:
            cell = _Cell(notes=["accounting was not started for this cell"])
        report: dict[str, Any] = {
            "wall_seconds": round(float(wall_seconds), 6),
            "cpu_seconds": None,
            "cpu_user_seconds": None,
            "cpu_system_seconds": None,
            "peak_memory_bytes": None,
            "files": None,
            "egress": None,
            "packages": None,
            "notes": cell.notes,
        }
        try:
            report["egress"] = self._egress(cell)
            container_id, mount, _ = self._container()
            if container_id != cell.container_id and cell.container_id is not None:
                cell.notes.append(
                    "the container was replaced during the cell: CPU and memory are not known"
                    if container_id
                    else "the container is gone: CPU and memory are not known"
                )
                cell.close()
                cell.cgroup = None
            try:
                self._finish_cgroup(cell, report)  # sysfs reads of a few microseconds
            finally:
                cell.close()
            if cell.files is not None and cell.mount is not None and mount == cell.mount:
                changed = self._changed(cell.mount, cell) if cell.watched else None
                if changed is False:  # nothing changed or opened a file: the baseline holds, no walk
                    report["files"], notes = workspace_scan.unchanged(cell.files)
                    cell.notes.extend(notes)
                    report["packages"] = workspace_scan.package_changes(cell.files, cell.files)
                    self._baseline = (cell.mount, cell.files)
                else:
                    after = await asyncio.to_thread(self._finish_files, cell, report)
                    if after is not None:
                        self._baseline = (cell.mount, after)
        except Exception as err:
            log.warning("accounting could not finish: %s", err, exc_info=True, extra={"session": self._session.id})
            cell.notes.append(f"accounting could not finish: {type(err).__name__}")
        finally:
            cell.close()
        return report

    def _finish_files(self, cell: _Cell, report: dict[str, Any]) -> workspace_scan.Snapshot | None:
        """The workspace's snapshot (returned: the next cell's baseline) and its diff with the
        cell's baseline, hashed."""
        assert cell.files is not None and cell.mount is not None
        try:
            after = self._snapshot(cell.mount)
        except OSError as err:
            cell.notes.append(f"the workspace could not be scanned ({err.strerror or type(err).__name__})")
            return None
        report["files"], notes = workspace_scan.diff(cell.mount, cell.files, after)
        cell.notes.extend(notes)
        report["packages"] = workspace_scan.package_changes(cell.files, after)
        return after

    @staticmethod
    def _finish_cgroup(cell: _Cell, report: dict[str, Any]) -> None:
        if cell.cgroup is None:
            return
        gone = "the container's cgroup is gone (the container ended during the cell)"
        if cell.cpu is not None:
            try:
                spent = cell.cgroup.cpu_times().since(cell.cpu)
                report["cpu_seconds"] = spent.total
                report["cpu_user_seconds"] = spent.user
                report["cpu_system_seconds"] = spent.system
            except (OSError, ValueError, KeyError):
                cell.notes.append(gone)
                return
        if cell.peak is not None:
            try:
                report["peak_memory_bytes"], note = cell.peak.peak()
            except (OSError, ValueError):
                cell.notes.append(gone)
                return
            if note:
                cell.notes.append(note)

    def _egress(self, cell: _Cell) -> dict[str, int] | None:
        """Counts of the proxy records added since start (on the loop, where they are added)."""
        proxy = self._proxy()
        if proxy is None:
            return None
        counts = {"allowed": 0, "refused": 0, "failed": 0}
        verdicts = {"allowed": "allowed", "denied": "refused", "failed": "failed"}
        records = proxy.records
        if proxy is not cell.proxy:  # a new provisioner (the container was replaced): all of its records
            new = len(records)
        elif cell.last_record is not None and records.maxlen is not None and len(records) >= records.maxlen:
            # The deque is full, so its length no longer grows: count back to the record last seen.
            new = next((i for i, record in enumerate(reversed(records)) if record is cell.last_record), None)
            if new is None:
                new = len(records)
                cell.notes.append("egress counts are a lower bound: more requests than the proxy keeps")
        else:
            new = len(records) - cell.seen_records
        for record in itertools.islice(reversed(records), max(new, 0)):
            counts[verdicts.get(record.verdict, "failed")] += 1
        return counts


class _CloseWithSession(SessionObserver):
    """Closes the meter's watch when its session closes (shut down or detached)."""

    def __init__(self, meter: CellMeter) -> None:
        self._meter = meter

    async def session_closed(self) -> None:
        self._meter.close()
