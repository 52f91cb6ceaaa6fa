"""The operator's production controls, attached to every session the gateway holds.

One object built at start-up from the settings: the execution policy (a gate asked before any
code reaches a kernel), the session circuit breaker (a gate and an observer), per-cell
accounting (on or off), the audit stream (an observer, a gate that holds back a tenant the log
cannot keep up with, plus the records the registry writes for session lifecycle and files) and
the start breaker (around every cold sandbox start). gateway/wiring.py puts their gates and
observers on every session the registry takes on (created, handed out of the pool, adopted,
resumed, forked), so no door can run code around them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sandkernel.gateway.audit.log import AuditLog
from sandkernel.gateway.breakers import StartBreaker
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.policy import ExecPolicy, load_policy
from sandkernel.kernels.sandbox.state_dir import state_dir

AUDIT_SUBDIR = "audit"
MiB = 2**20


@dataclasses.dataclass
class SessionControls:
    """What the operator turned on (attached to each session by gateway/wiring.py)."""

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

    async def close(self) -> None:
        """Flush the audit stream (the gateway stops)."""
        if self.audit is not None:
            await self.audit.close()


def audit_dir(settings: GatewaySettings) -> Path:
    """Where the audit stream goes: the operator's choice, else under the state dir."""
    return settings.audit_dir if settings.audit_dir is not None else state_dir(AUDIT_SUBDIR)
