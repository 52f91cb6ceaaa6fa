"""One tenant's snapshot bytes against its quota, counted while archives are being written.

Why: the quota used to be checked against committed snapshots only, before a capture began, and
each capture could then write all that was left: twenty pauses (or per-cell checkpoints) at once
could each write the whole quota. Here every byte a capture writes is taken as it is written
(:meth:`Allowance.take`, from the capture's thread) and a capture commits only if it still fits
(:meth:`Allowance.claim`), so the committed bytes never pass the quota.

Concurrent captures are served oldest first: a capture's room is the quota less the committed
bytes and what the captures started before it have written; the younger ones give way (they stop
with SnapshotQuotaError once the older ones leave no room). Without an order, three captures that
each fit alone but not together could all run out of room halfway, and none would be kept. While
they run, the partial archives of captures that are about to fail may hold up to about one quota
more on disk, removed as each one stops.

The committed bytes come from the store (a walk of the tenant's signed manifests) at the start of
each capture; between walks, a capture that commits adds its bytes. A walk that ran while a
capture settled is not applied (its count could miss that commit): the count can only be too
high until the next walk (a snapshot removed meanwhile), never too low.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable

# The window --checkpoint-mb-per-minute counts over.
CHECKPOINT_WINDOW_SECONDS = 60.0


class TenantSnapshotBytes:
    """One tenant's snapshot bytes: committed, and being written now. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed = 0
        self._active: dict[int, Allowance] = {}  # captures under way, oldest first
        self._order = itertools.count()
        self._changes = 0  # claims and releases so far: a walk older than one is stale

    @property
    def used(self) -> int:
        """Committed bytes and those being written."""
        with self._lock:
            return self._committed + sum(a.taken for a in self._active.values())

    def refresh(self, walk: Callable[[], int]) -> int:
        """Read the committed bytes again with ``walk`` (blocking: call it in a thread) unless a
        capture settled meanwhile. Returns the bytes in use, written ones included."""
        with self._lock:
            before = self._changes
        committed = walk()
        with self._lock:
            if self._changes == before:
                self._committed = committed
            return self._committed + sum(a.taken for a in self._active.values())

    def allowance(self, quota: int) -> Allowance:
        """A new capture's share of the room under ``quota``, younger than every one under way."""
        with self._lock:
            allowance = Allowance(self, quota, next(self._order))
            self._active[allowance.order] = allowance
            return allowance

    def _room_before(self, allowance: Allowance) -> int:
        """The quota less the committed bytes and what older captures have written (lock held)."""
        older = sum(a.taken for order, a in self._active.items() if order < allowance.order)
        return allowance.quota - self._committed - older

    def _take(self, allowance: Allowance, size: int) -> bool:
        with self._lock:
            if allowance.taken + size > self._room_before(allowance):
                return False
            allowance.taken += size
            return True

    def _claim(self, allowance: Allowance) -> bool:
        with self._lock:
            if allowance.order not in self._active or allowance.taken > self._room_before(allowance):
                return False
            del self._active[allowance.order]
            self._committed += allowance.taken
            allowance.claimed = True
            self._changes += 1
            return True

    def _settle(self, allowance: Allowance, kept: bool) -> None:
        with self._lock:
            if allowance.claimed and not kept:  # claimed, then the commit itself failed
                self._committed -= allowance.taken
            self._active.pop(allowance.order, None)
            self._changes += 1


class Allowance:
    """What one capture has written against its tenant's quota: :meth:`take` before each write,
    :meth:`claim` just before the snapshot is committed, :meth:`settle` once at the end (kept:
    the commit went through; otherwise its bytes are free again)."""

    def __init__(self, tenant: TenantSnapshotBytes, quota: int, order: int) -> None:
        self.tenant = tenant
        self.quota = quota
        self.order = order
        self.taken = 0
        self.claimed = False

    def take(self, size: int) -> bool:
        """Room for ``size`` more bytes, taken now; False (nothing taken) when there is none."""
        return self.tenant._take(self, size)

    def give_back(self, size: int) -> None:
        """Return ``size`` of what was taken (a reservation larger than what was written)."""
        with self.tenant._lock:
            self.taken -= min(size, self.taken)

    def claim(self) -> bool:
        """Count what was written as committed, if it still fits (older captures first)."""
        return self.tenant._claim(self)

    def settle(self, kept: bool) -> None:
        self.tenant._settle(self, kept)


class WrittenInWindow:
    """Bytes written in the last ``seconds`` (a tenant's per-cell checkpoints): one entry per
    write, dropped once older than the window."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._writes: collections.deque[tuple[float, int]] = collections.deque()
        self._total = 0

    def add(self, size: int, now: float | None = None) -> None:
        self._writes.append((time.monotonic() if now is None else now, size))
        self._total += size

    def total(self, now: float | None = None) -> int:
        clock = time.monotonic() if now is None else now
        while self._writes and self._writes[0][0] <= clock - self.seconds:
            self._total -= self._writes.popleft()[1]
        return self._total


__all__ = ["CHECKPOINT_WINDOW_SECONDS", "Allowance", "TenantSnapshotBytes", "WrittenInWindow"]
