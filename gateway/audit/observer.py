"""The audit stream's session observer: one record per execution and per kernel restart.

Attached by the gateway to every session it holds (gateway/controls.py), whichever door runs
the code, so the record is written where the result is known: after the execution ended, with
the accounting (CPU, memory, files written with their SHA-256, egress, packages), the policy's
findings and any refusal. An execution the audit gate refused (gate.py) keeps its code's SHA-256
and length but not its text: its tenant is already writing too much. Session lifecycle and file
API records are written by the registry with :meth:`AuditLog.record` directly. Everything here
runs on the event loop and only queues: bounding, hashing the code and writing happen on the
log's worker thread.
"""

from __future__ import annotations

from typing import Any

from sandkernel.gateway.audit.fields import DigestOnly
from sandkernel.gateway.audit.gate import BY
from sandkernel.gateway.audit.log import AuditLog
from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult


def execution_fields(request: ExecutionRequest, result: ExecutionResult) -> dict[str, Any]:
    """The fields of an ``execution`` record (besides tenant and session)."""
    refused_by_audit = result.refusal is not None and result.refusal.get("by") == BY
    fields: dict[str, Any] = {
        "door": request.source,
        "msg_id": request.msg_id,
        # the log keeps its SHA-256, and its start unless the operator turned that off
        "code": DigestOnly(request.code) if refused_by_audit else request.code,
        "status": result.status.value,
        "execution_count": result.execution_count,
        "started_at": result.started_at,
        "duration": result.duration,
    }
    if request.shell is not None:
        fields["shell"] = DigestOnly(request.shell) if refused_by_audit else request.shell
    if request.silent:
        fields["silent"] = True
    if request.tag is not None:
        fields["tag"] = request.tag
    if result.error is not None:
        fields["error"] = result.error.name
    if result.ended_by is not None:
        fields["ended_by"] = result.ended_by.value
    if result.state_lost:
        fields["state_lost"] = result.state_lost
    if result.accounting is not None:
        fields["accounting"] = result.accounting
    if result.policy:
        fields["policy"] = list(result.policy)
    if result.refusal is not None:
        fields["refusal"] = result.refusal
    return fields


class AuditObserver(SessionObserver):
    """Writes a session's executions, restarts and notes to the audit stream."""

    def __init__(self, tenant: str, session_id: str, audit: AuditLog) -> None:
        self.tenant = tenant
        self.session_id = session_id
        self.audit = audit

    def _record(self, event: str, **fields: Any) -> None:
        self.audit.record(event, tenant=self.tenant, session=self.session_id, **fields)

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        self._record("execution", **execution_fields(request, result))

    async def kernel_restarted(self, reason: str, container_replaced: bool) -> None:
        self._record("kernel_restarted", reason=reason, container_replaced=container_replaced)

    async def note_added(self, text: str) -> None:
        # hidden requests that ran code (silent executes, debugger evaluations), state lost, ...
        self._record("note", text=text)
