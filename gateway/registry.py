"""Sessions the gateway owns, indexed by session id and kernel id, scoped by tenant.

A Jupyter "kernel" started through /api/kernels and an agent "session" started through
/api/sessions are the same thing here: a :class:`KernelSession`. Lookups take the caller's
tenant, and another tenant's session is reported exactly like a missing one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from sandkernel.kernels.session import KernelSession

from sandkernel.errors import ConfigError, KernelNotFoundError

log = logging.getLogger(__name__)


class TooManySessionsError(ConfigError):
    """A tenant is at its session limit."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclasses.dataclass
class ManagedSession:
    session: KernelSession
    tenant: str
    created: str
    metadata: dict[str, Any]
    kernel_name: str
    last_activity: str = dataclasses.field(default_factory=_now)
    execution_state: str = "idle"
    connections: int = 0

    @property
    def id(self) -> str:
        return self.session.id

    def touch(self, state: str | None = None) -> None:
        self.last_activity = _now()
        if state:
            self.execution_state = state

    def kernel_model(self) -> dict[str, Any]:
        """The Jupyter kernel model (what /api/kernels returns)."""
        return {
            "id": self.session.kernel_id,
            "name": self.kernel_name,
            "last_activity": self.last_activity,
            "execution_state": self.execution_state,
            "connections": self.connections,
        }

    def session_model(self) -> dict[str, Any]:
        """A superset of Jupyter's session model."""
        return {
            "id": self.id,
            "path": f"sessions/{self.id}.ipynb",
            "name": self.metadata.get("name", ""),
            "type": "notebook",
            "kernel": self.kernel_model(),
            "created": self.created,
            "profile": self.session.profile.to_dict(),
            "metadata": self.metadata,
        }


class SessionRegistry:
    """Owns every live session of the gateway."""

    def __init__(self, max_sessions_per_tenant: int = 20) -> None:
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self._sessions: dict[str, ManagedSession] = {}
        self._pending: dict[str, int] = {}

    async def create(
        self,
        tenant: str,
        profile: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> ManagedSession:
        count = sum(1 for s in self._sessions.values() if s.tenant == tenant) + self._pending.get(tenant, 0)
        if count >= self.max_sessions_per_tenant:
            raise TooManySessionsError(
                f"session limit reached ({self.max_sessions_per_tenant} per token); delete a session first"
            )
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        try:
            session = await KernelSession.start(profile=profile, overrides=overrides)
        finally:
            self._pending[tenant] -= 1
        kernel_name = "sandkernel-python-gvisor" if session.profile.runtime.value == "runsc" else "sandkernel-python"
        managed = ManagedSession(session, tenant, _now(), dict(metadata or {}), kernel_name)
        self._sessions[session.id] = managed
        log.info("session created", extra={"session": session.id, "tenant": tenant})
        return managed

    def get(self, tenant: str, session_id: str) -> ManagedSession:
        managed = self._sessions.get(session_id)
        if managed is None or managed.tenant != tenant:
            raise KernelNotFoundError(f"no session {session_id!r}")
        return managed

    def by_kernel(self, tenant: str, kernel_id: str) -> ManagedSession:
        # A session's kernel id changes when the ladder replaces its container: look it up live.
        for managed in self._sessions.values():
            if managed.session.kernel_id == kernel_id and managed.tenant == tenant:
                return managed
        raise KernelNotFoundError(f"no kernel {kernel_id!r}")

    def list(self, tenant: str) -> list[ManagedSession]:
        return [s for s in self._sessions.values() if s.tenant == tenant]

    async def delete(self, tenant: str, session_id: str) -> None:
        managed = self.get(tenant, session_id)
        self._sessions.pop(session_id, None)
        await managed.session.shutdown()

    async def shutdown_all(self) -> None:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        await asyncio.gather(*(s.session.shutdown() for s in sessions), return_exceptions=True)
