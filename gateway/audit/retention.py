"""What the audit directory keeps: history by age, within a disk budget, and who holds it.

Retention used to be a number of rotated files, so any tenant writing enough (a burst of large
cells) rotated everyone's earlier records away within minutes (issue 30, item 6). Now:

* **Age.** A rotated file is deleted once its last record is ``keep_days`` old (its mtime: the
  file is not written after it is rotated), oldest first and never one younger than a file kept,
  so what stays is one unbroken piece of the chain. Files younger than that are never deleted by
  the gateway: however much anyone writes, the last ``keep_days`` days of history stay.
* **Disk budget.** ``max_disk_bytes`` for everything in the directory. Reaching it with files
  past their age deletes those (at once: the log rotates to do it, and ``log_rotated`` names
  them). Reaching it with young files only makes the budget *full*: nothing is deleted, and the
  audit gate refuses the executions of the tenants holding the most of the retained bytes
  (:meth:`Retention.heaviest_holders`) until files age out or the operator raises the budget. The
  budget is a limit on what tenants can make the log grow by, not a wall: records already made
  (the refusals themselves, sessions created and deleted, tenants that hold little) are still
  written. Deleting young history instead would let the tenant who filled the budget erase the
  others' records, which is the attack this stops.
* **Who holds what.** Bytes per tenant of the file being written, counted as lines are written;
  at rotation they go into the ``log_rotated`` record (``tenant_bytes``) that starts the next
  file, so a restarted gateway rebuilds the holdings of every retained file from the first
  records alone (and of the current file by reading it once). Files from before this was
  recorded count toward the budget but toward no tenant.

The worker thread changes all of this; the gate reads :attr:`full` and the holdings on the event
loop, hence the lock.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

from sandkernel.gateway.audit.chain import CURRENT_NAME
from sandkernel.gateway.audit.files import (
    read_first_record,
    rotated_names,
    stat_file,
    stored_bytes,
    tenant_bytes,
)
from sandkernel.gateway.audit.usage import heaviest

log = logging.getLogger(__name__)

DAY_SECONDS = 86_400


class Retention:
    """The retention rules of one audit directory and the state they need (see the module)."""

    def __init__(self, keep_days: float | None, max_disk_bytes: int | None) -> None:
        self.keep_seconds = keep_days * DAY_SECONDS if keep_days is not None else None
        self.max_disk_bytes = max_disk_bytes
        self.full = False
        self._lock = threading.Lock()
        self._stored = 0  # bytes in the directory besides the current file
        self._held: dict[str, collections.Counter[str]] = {}  # rotated file -> bytes per tenant
        self._current: collections.Counter[str] = collections.Counter()
        self._oldest_mtime: float | None = None

    # -- the worker thread ----------------------------------------------------------------------
    def load(self, dir_fd: int, current_fd: int | None) -> None:
        """What the directory holds now: sizes, and each file's tenants (from the ``log_rotated``
        records; the current file, ``current_fd``, read whole)."""
        held: dict[str, collections.Counter[str]] = {}
        for name in [*rotated_names(dir_fd), CURRENT_NAME]:
            record = read_first_record(dir_fd, name)
            if record is None or record.get("event") != "log_rotated":
                continue
            previous, counts = record.get("previous_file"), record.get("tenant_bytes")
            if isinstance(previous, str) and isinstance(counts, dict):
                held[previous] = collections.Counter(
                    {t: n for t, n in counts.items() if isinstance(n, int) and not isinstance(n, bool)}
                )
        current = collections.Counter(tenant_bytes(current_fd)) if current_fd is not None else collections.Counter()
        with self._lock:
            self._held = {name: counts for name, counts in held.items() if stat_file(dir_fd, name) is not None}
            self._current = current
        self.rescan(dir_fd)

    def wrote(self, tenant: object, size: int) -> None:
        """A line of ``size`` bytes naming ``tenant`` went into the current file."""
        if isinstance(tenant, str):
            with self._lock:
                self._current[tenant] += size

    def rotated(self, name: str) -> dict[str, int]:
        """The current file became ``name``: its holdings move with it (and are returned, for the
        ``log_rotated`` record)."""
        with self._lock:
            counts, self._current = self._current, collections.Counter()
            self._held[name] = counts
        return dict(counts)

    def expired(self, dir_fd: int, now: float | None = None) -> list[str]:
        """Rotated files past their age, oldest first, up to the first one that is not."""
        if self.keep_seconds is None:
            return []
        cutoff = (time.time() if now is None else now) - self.keep_seconds
        out = []
        for name in rotated_names(dir_fd):
            st = stat_file(dir_fd, name)
            if st is not None and st.st_mtime >= cutoff:
                break
            out.append(name)
        return out

    def expire(self, dir_fd: int, now: float | None = None) -> list[str]:
        """Delete the files :meth:`expired` names; the names deleted."""
        removed = []
        for name in self.expired(dir_fd, now):
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.error("cannot delete the old audit file %s: %s", name, err)
                break  # keep the rest contiguous
            removed.append(name)
        with self._lock:
            for name in removed:
                self._held.pop(name, None)
        self.rescan(dir_fd)
        return removed

    def rescan(self, dir_fd: int) -> None:
        """Sizes of the files besides the current one (after a rotation or a deletion)."""
        names = rotated_names(dir_fd)
        st = stat_file(dir_fd, names[0]) if names else None
        self._stored = stored_bytes(dir_fd)
        self._oldest_mtime = st.st_mtime if st is not None else None

    def used(self, current_size: int) -> int:
        """Bytes in the directory, the current file's ``current_size`` included."""
        return self._stored + current_size

    def over_budget(self, current_size: int) -> bool:
        return self.max_disk_bytes is not None and self.used(current_size) >= self.max_disk_bytes

    def update_full(self, current_size: int) -> None:
        """Mark the budget full (or not) now that nothing past its age is left to delete; say so
        in the gateway's log when that changes."""
        full = self.over_budget(current_size)
        if full and not self.full:
            log.error(
                "the audit log's disk budget (%d bytes) is full of records younger than its retention; nothing is "
                "deleted: executions of the tenants holding the most of it are refused until files age out "
                "(raise --audit-max-mb or lower --audit-keep-days)",
                self.max_disk_bytes,
                extra={"audit_bytes": self.used(current_size), "audit_holders": self.holdings()},
            )
        elif self.full and not full:
            log.warning("the audit log's disk budget has room again")
        self.full = full

    # -- the gate (event loop) ------------------------------------------------------------------
    def holdings(self) -> dict[str, int]:
        """Bytes of retained history per tenant."""
        with self._lock:
            total = collections.Counter(self._current)
            for counts in self._held.values():
                total.update(counts)
        return dict(total)

    def heaviest_holders(self) -> set[str]:
        """The tenants holding the most of the retained history (see usage.heaviest)."""
        return heaviest(self.holdings())

    def seconds_until_oldest_expires(self, now: float | None = None) -> int | None:
        """When the oldest rotated file is past its age (None: no file, or kept for ever)."""
        if self.keep_seconds is None or self._oldest_mtime is None:
            return None
        return max(0, int(self._oldest_mtime + self.keep_seconds - (time.time() if now is None else now)))
