"""Bytes and requests a websocket client has sent to its kernel and not yet had answered.

A request counts as in flight from the moment it arrives until the kernel answers it (its
reply, or its ``idle`` status). A connection, and a tenant across all its connections, may have
only so many bytes and requests in flight; past that the websocket is closed with 1008 (policy
violation) and a reason saying what to do, so a client that sends faster than its kernel runs
cannot queue gigabytes in the gateway. Other tenants have their own budgets.
"""

from __future__ import annotations

import weakref

# Bytes of client requests one websocket may have sent to its kernel and not yet had answered.
# A JupyterLab "run all" of a large notebook is a few MB; a client sending 16 MiB frames faster
# than the kernel runs them is refused at this bound (1008) instead of queueing in the gateway.
MAX_PENDING_BYTES_PER_CONNECTION = 32 * 1024 * 1024
# The same bound across all of one tenant's websocket connections (bytes): a tenant cannot
# multiply it by opening connections, and other tenants keep theirs.
MAX_PENDING_BYTES_PER_TENANT = 128 * 1024 * 1024
# Requests one websocket may have awaiting an answer: each queued execute keeps a small record
# in the gateway, so even tiny requests are bounded (a "run all" of 1000 cells fits).
MAX_PENDING_REQUESTS_PER_CONNECTION = 1024


class TenantLedger:
    """Bytes in flight per tenant, across that tenant's websocket connections."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def add(self, tenant: str, size: int) -> int:
        self.pending[tenant] = self.pending.get(tenant, 0) + size
        return self.pending[tenant]

    def release(self, tenant: str, size: int) -> None:
        left = self.pending.get(tenant, 0) - size
        if left > 0:
            self.pending[tenant] = left
        else:
            self.pending.pop(tenant, None)


# One ledger per gateway, keyed by its session registry (which lives exactly as long).
_LEDGERS: weakref.WeakKeyDictionary[object, TenantLedger] = weakref.WeakKeyDictionary()


def ledger_of(registry: object) -> TenantLedger:
    """The tenant ledger of the gateway that owns ``registry``."""
    ledger = _LEDGERS.get(registry)
    if ledger is None:
        ledger = _LEDGERS[registry] = TenantLedger()
    return ledger


class InFlight:
    """One connection's requests in flight, counted into its tenant's ledger."""

    def __init__(self, tenant: str, ledger: TenantLedger) -> None:
        self.tenant = tenant
        self.ledger = ledger
        self.pending: dict[str, int] = {}  # msg_id -> bytes awaiting an answer
        self.pending_bytes = 0

    def admit(self, msg_id: str, size: int) -> str | None:
        """Count a request as in flight; or, over a budget, return why it is refused (nothing counted)."""
        if len(self.pending) >= MAX_PENDING_REQUESTS_PER_CONNECTION:
            return f"over {MAX_PENDING_REQUESTS_PER_CONNECTION} requests await the kernel; wait for replies"
        if self.pending_bytes + size > MAX_PENDING_BYTES_PER_CONNECTION:
            return f"over {MAX_PENDING_BYTES_PER_CONNECTION >> 20} MiB of requests await the kernel; wait for replies"
        if self.ledger.pending.get(self.tenant, 0) + size > MAX_PENDING_BYTES_PER_TENANT:
            return f"tenant has over {MAX_PENDING_BYTES_PER_TENANT >> 20} MiB of requests in flight; wait for replies"
        size += self.pending.pop(msg_id, 0)  # a reused msg_id adds to the same entry
        self.pending[msg_id] = size
        self.pending_bytes += size
        self.ledger.add(self.tenant, size)
        return None

    def answered(self, msg_id: str | None) -> None:
        size = self.pending.pop(msg_id, None) if msg_id else None
        if size is not None:
            self.pending_bytes -= size
            self.ledger.release(self.tenant, size)

    def forget_all(self) -> None:
        """Nothing in flight will be answered (the kernel restarted, or the websocket closed)."""
        for msg_id in list(self.pending):
            self.answered(msg_id)
