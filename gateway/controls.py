"""The operator's production controls, attached to every session the gateway holds.

One object built at start-up from the settings: the execution policy (a gate asked before any
code reaches a kernel), the session circuit breaker (a gate and an observer), per-cell
accounting (on or off), the audit stream (an observer, a gate that holds back a tenant the log
cannot keep up with, plus the records the registry writes for session lifecycle and files) and
the start breaker (around every cold sandbox start). The registry calls
:meth:`SessionControls.attach` wherever it takes a session on (created, handed out of the pool,
adopted), so no door can run code around them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sandkernel.gateway.audit.gate import AuditGate
from sandkernel.gateway.audit.log import AuditLog
from sandkernel.gateway.audit.observer import AuditObserver
from sandkernel.gateway.breakers import SessionBreaker, StartBreaker
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.execution.events import ExecutionGate
from sandkernel.kernels.policy import ExecPolicy, PolicyGate, load_policy
from sandkernel.kernels.sandbox.state_dir import state_dir

if TYPE_CHECKING:
    from sandkernel.gateway.managed import ManagedSession
    from sandkernel.kernels.execution.session import KernelSession

AUDIT_SUBDIR = "audit"
MiB = 2**20


@dataclasses.dataclass
class SessionControls:
    """What the operator turned on, and the one place it is attached to a session."""

    settings: GatewaySettings
    metrics: GatewayMetrics
    start_breaker: StartBreaker
    policy: ExecPolicy | None = None
    audit: AuditLog | None = None

    @classmethod
    def from_settings(cls, settings: GatewaySettings, metrics: GatewayMetrics) -> SessionControls:
        """Read the policy file (ConfigError names the line at fault) and open the audit stream
        (both blocking: called once at start-up, before the gateway listens)."""
        policy = load_policy(settings.exec_policy_file) if settings.exec_policy_file is not None else None
        audit = None
        if settings.audit:
            audit = AuditLog.open(
                audit_dir(settings),
                include_code=settings.audit_code,
                max_bytes=settings.audit_max_bytes,
                keep_days=settings.audit_keep_days,
                max_disk_bytes=settings.audit_max_mb * MiB,
                tenant_bytes_per_minute=settings.audit_tenant_mb_per_minute * MiB,
            )
        return cls(settings, metrics, StartBreaker(settings, metrics), policy, audit)

    def attach(self, managed: ManagedSession) -> None:
        """Put the controls on a session the registry takes on: the audit gate first (the
        cheapest, and a tenant the log cannot keep up with should not cost a policy review
        either), then the policy (a refused cell never counts toward the breaker), the breaker,
        accounting and the audit observer."""
        session = managed.session
        session.set_accounting(self.settings.accounting)
        if self.audit is not None:
            session.add_gate(AuditGate(self.audit, managed.tenant))
        if self.policy is not None:
            session.add_gate(PolicyGate(self.policy))
        breaker = SessionBreaker(managed, self.settings, self.metrics)
        managed.breaker = breaker
        session.add_gate(breaker)
        session.add_observer(breaker)
        managed.audit = self.audit
        if self.audit is not None:
            session.add_observer(AuditObserver(managed.tenant, managed.id, self.audit))

    @contextlib.contextmanager
    def on_replay(self, session: KernelSession, tenant: str) -> Iterator[None]:
        """The gates and audit new code passes, on the cells a sandbox replays before the
        registry takes it on (resume, rewind, fork): the operator's policy as it is now (it may
        have been tightened since the cells first ran), the audit gate, and an audit record per
        replayed cell (``door`` replay). Taken off at the end; :meth:`attach` puts on its own."""
        gates: list[ExecutionGate] = []
        if self.audit is not None:
            gates.append(AuditGate(self.audit, tenant))
        if self.policy is not None:
            gates.append(PolicyGate(self.policy))
        observer = AuditObserver(tenant, session.id, self.audit) if self.audit is not None else None
        for gate in gates:
            session.add_gate(gate)
        if observer is not None:
            session.add_observer(observer)
        try:
            yield
        finally:
            for gate in gates:
                session.remove_gate(gate)
            if observer is not None:
                session.remove_observer(observer)

    async def close(self) -> None:
        """Flush the audit stream (the gateway stops)."""
        if self.audit is not None:
            await self.audit.close()


def audit_dir(settings: GatewaySettings) -> Path:
    """Where the audit stream goes: the operator's choice, else under the state dir."""
    return settings.audit_dir if settings.audit_dir is not None else state_dir(AUDIT_SUBDIR)
