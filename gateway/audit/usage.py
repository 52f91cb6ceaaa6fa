"""Who is writing the audit log: each tenant's bytes in the last minute, and who "the heaviest" are.

The log's worker thread adds the size of every line it writes to the tenant the record names; the
audit gate (gate.py) reads it on the event loop before an execution runs. So one tenant writing
large cells in a burst is refused while it is over its rate, and nobody else is: a shared limit
would let that tenant spend everyone's share of the log (issue 30, item 6).

Counts are kept per second (at most :data:`WINDOW_SECONDS` entries per tenant, however many records
a tenant writes), under a lock: two threads touch them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Mapping

WINDOW_SECONDS = 60

# Why the audit gate refuses an execution (the refusal's ``rule``).
TENANT_RATE = "audit_tenant_rate"  # this tenant's records passed its bytes per minute
QUEUE_HIGH_WATER = "audit_queue_high_water"  # the writer is behind, and this tenant queued the most
DISK_BUDGET = "audit_disk_budget"  # the budget is full of history too young to delete; this tenant holds the most


@dataclasses.dataclass(frozen=True)
class Pressure:
    """Why a tenant's executions wait now: the rule, when to retry (seconds), and the numbers the
    message quotes (bytes or records, depending on the rule)."""

    rule: str
    retry_after: int
    amount: int = 0
    limit: int = 0


def heaviest(counts: Mapping[str, int]) -> set[str]:
    """The tenants at or above the mean of those with anything counted: at least the largest one
    (when any is counted), never a tenant far below the others. One tenant flooding is the only
    one named; tenants sharing the load evenly are all named (the resource is simply too small)."""
    present = {tenant: count for tenant, count in counts.items() if count > 0}
    if not present:
        return set()
    mean = sum(present.values()) / len(present)
    return {tenant for tenant, count in present.items() if count >= mean}


class TenantWindow:
    """Bytes of audit records per tenant in the last :data:`WINDOW_SECONDS` seconds."""

    def __init__(self, seconds: int = WINDOW_SECONDS) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._buckets: dict[str, collections.deque[list[int]]] = {}  # tenant -> [[second, bytes], ...]

    def add(self, tenant: str, size: int, now: float | None = None) -> None:
        """Count ``size`` bytes written for ``tenant`` (the worker thread, after each line)."""
        second = int(time.monotonic() if now is None else now)
        with self._lock:
            buckets = self._buckets.setdefault(tenant, collections.deque())
            if buckets and buckets[-1][0] == second:
                buckets[-1][1] += size
            else:
                buckets.append([second, size])
            self._prune(tenant, second)

    def total(self, tenant: str, now: float | None = None) -> int:
        """``tenant``'s bytes in the window."""
        second = int(time.monotonic() if now is None else now)
        with self._lock:
            self._prune(tenant, second)
            return sum(size for _, size in self._buckets.get(tenant, ()))

    def totals(self, now: float | None = None) -> dict[str, int]:
        """Every tenant's bytes in the window (tenants with none left are forgotten)."""
        second = int(time.monotonic() if now is None else now)
        with self._lock:
            for tenant in list(self._buckets):
                self._prune(tenant, second)
            return {tenant: sum(size for _, size in buckets) for tenant, buckets in self._buckets.items()}

    def seconds_until_within(self, tenant: str, limit: int, now: float | None = None) -> int:
        """Whole seconds until ``tenant``'s bytes in the window are at most ``limit``, if it writes
        nothing more (0: they are)."""
        clock = time.monotonic() if now is None else now
        with self._lock:
            self._prune(tenant, int(clock))
            buckets = [(second, size) for second, size in self._buckets.get(tenant, ())]
        left = sum(size for _, size in buckets)
        if left <= limit:
            return 0
        for second, size in buckets:
            left -= size
            if left <= limit:  # once this second's bytes leave the window
                return max(1, math.ceil(second + self.seconds - clock))
        return self.seconds

    def _prune(self, tenant: str, second: int) -> None:
        buckets = self._buckets.get(tenant)
        if buckets is None:
            return
        while buckets and buckets[0][0] <= second - self.seconds:
            buckets.popleft()
        if not buckets:
            del self._buckets[tenant]
