"""The audit gate: a tenant whose records the audit log cannot keep up with waits, and nobody else.

Attached by the gateway to every session it holds, before the other gates (gateway/controls.py),
so every door is held back the same way. It asks :meth:`AuditLog.pressure` (cheap: counters and
a lock) and refuses the execution before it runs (status ``refused``, ``refusal.by == "audit"``)
with what happened and when to retry (``refusal.retry_after``, seconds). Why fail closed, for
that one tenant, rather than write on: the alternatives are to drop records (the queue's last
resort) or to delete history younger than the operator's retention, and either would let one
tenant erase what the others did. Why not a shared limit: one tenant would then spend everyone's.

The refused execution is still recorded, with its code's SHA-256 and length but not its text
(observer.py), so a tenant flooding the gate cannot flood the log with what it was refused.
"""

from __future__ import annotations

from sandkernel.gateway.audit.fields import MAX_CODE_CHARS
from sandkernel.gateway.audit.log import AuditLog
from sandkernel.gateway.audit.usage import DISK_BUDGET, QUEUE_HIGH_WATER, TENANT_RATE, WINDOW_SECONDS, Pressure
from sandkernel.kernels.execution.events import ALLOW, ExecutionRequest, Verdict

BY = "audit"
_NOTHING_RAN = "The gateway's audit log refused this execution before it ran (nothing was executed)"


class AuditGate:
    """An :class:`~sandkernel.kernels.execution.events.ExecutionGate` for one session's tenant."""

    def __init__(self, audit: AuditLog, tenant: str) -> None:
        self.audit = audit
        self.tenant = tenant

    async def admit(self, request: ExecutionRequest) -> Verdict:
        pressure = self.audit.pressure(self.tenant)
        if pressure is None:
            return ALLOW
        refusal = {"by": BY, "rule": pressure.rule, "message": message(pressure), "retry_after": pressure.retry_after}
        return Verdict(refusal=refusal)


def message(pressure: Pressure) -> str:
    """What a model (or a person in JupyterLab) reads: what is held back, why, when to retry."""
    retry = f"Retry in {pressure.retry_after} s"
    if pressure.rule == TENANT_RATE:
        return (
            f"{_NOTHING_RAN}: this tenant's executions wrote {_mib(pressure.amount)} of audit records in the last "
            f"{WINDOW_SECONDS} s, over the operator's limit of {_mib(pressure.limit)} per minute, which keeps one "
            f"tenant from pushing the others' records out of the audit history. {retry}; cells with less code "
            f"(the log keeps each cell's first {MAX_CODE_CHARS} characters) or fewer cells per minute stay under it."
        )
    if pressure.rule == QUEUE_HIGH_WATER:
        return (
            f"{_NOTHING_RAN}: the audit log is behind ({pressure.limit} records waiting to be written, "
            f"{pressure.amount} of them this tenant's, the most of any tenant). {retry}."
        )
    if pressure.rule == DISK_BUDGET:
        return (
            f"{_NOTHING_RAN}: the audit log's disk budget ({_mib(pressure.limit)}) is full of records too recent "
            f"to delete, and this tenant's records hold the most of it ({_mib(pressure.amount)}). {retry}: room "
            "comes back as the oldest records pass their retention, or when the operator raises the budget."
        )
    return f"{_NOTHING_RAN} ({pressure.rule}). {retry}."


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
