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
import time
import uuid
from collections.abc import Mapping
from typing import Any

from sandkernel.errors import ConfigError, KernelNotFoundError
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.session_observers import observe
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.catalog import ProfileCatalog
from sandkernel.kernels.lifecycle.pool import WarmPool
from sandkernel.kernels.sandbox.kernelspec import kernel_name_for
from sandkernel.notebooks.observer import attach_transcript
from sandkernel.notebooks.recorder import TranscriptRecorder, notebook_path_for

log = logging.getLogger(__name__)


class TooManySessionsError(ConfigError):
    """A tenant (or the gateway) is at its session limit."""

    status = 429


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
    origin: str = "session_api"  # or "kernel_api": who created it decides who may end it
    created_mono: float = dataclasses.field(default_factory=time.monotonic)
    recorder: TranscriptRecorder | None = None  # the session's transcript (an observer of it)
    active_mono: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.session.id

    def touch(self, state: str | None = None) -> None:
        self.last_activity = _now()
        self.active_mono = time.monotonic()
        if state:
            self.execution_state = state

    async def interrupt(self) -> None:
        """Interrupt the running execution: what both the kernel and the session API's
        ``/interrupt`` do."""
        await self.session.interrupt()

    async def restart(self) -> None:
        """Restart the kernel (memory state dropped, /workspace kept); the fresh kernel is idle
        whatever was running before: what both the kernel and the session API's ``/restart`` do."""
        await self.session.restart()
        self.touch("idle")

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
            "path": str(self.recorder.path) if self.recorder else None,
            "name": self.metadata.get("name", ""),
            "type": "notebook",
            "kernel": self.kernel_model(),
            "created": self.created,
            "profile": self.session.profile.to_dict(public=True),
            "metadata": self.metadata,
        }


class SessionRegistry:
    """Owns every live session of the gateway."""

    def __init__(
        self,
        settings: GatewaySettings,
        catalog: ProfileCatalog | None = None,
        pool: WarmPool | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """``settings`` gives the limits (sessions per tenant and in all, idle timeout, lifetime)
        and the notebook directory; ``catalog`` what tenants may ask for (built-in profiles when
        None); ``pool`` the warm sandboxes, if any; ``metrics`` the gateway's counters."""
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.pool = pool
        self.catalog = catalog or ProfileCatalog.load()
        self._sessions: dict[str, ManagedSession] = {}
        self._pending: dict[str, int] = {}
        self._closing: set[asyncio.Task] = set()

    async def create(
        self,
        tenant: str,
        profile: str | None = None,
        limits: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        origin: str = "session_api",
    ) -> ManagedSession:
        """Start a session for ``tenant``: the named profile with the ``limits`` the tenant asked
        for, checked against the operator's catalog (ConfigError / SettingNotPermittedError)."""
        chosen = self.catalog.for_tenant(profile, limits)
        count = sum(1 for s in self._sessions.values() if s.tenant == tenant) + self._pending.get(tenant, 0)
        if count >= self.settings.max_sessions:
            raise TooManySessionsError(
                f"session limit reached ({self.settings.max_sessions} per token); delete a session first"
            )
        reserved = self.pool.size if self.pool else 0  # pooled sandboxes count toward the limit
        if len(self._sessions) + sum(self._pending.values()) + reserved >= self.settings.max_sessions_total:
            raise TooManySessionsError(
                f"the gateway is at its limit of {self.settings.max_sessions_total} sessions; try again later"
            )
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        try:
            session = await self.pool.acquire() if self.pool and self.pool.matches(chosen) else None
            session_id = session.id if session else uuid.uuid4().hex
            recorder = TranscriptRecorder(
                notebook_path_for(session_id, self.settings.notebook_dir),
                {"tenant": tenant, "client_metadata": dict(metadata or {}), "warm_pool": session is not None},
            )
            if session is None:
                session = await KernelSession.start(profile=chosen, session_id=session_id)
            await attach_transcript(session, recorder)
        finally:
            self._pending[tenant] -= 1
        kernel_name = kernel_name_for(session.profile.runtime)
        managed = ManagedSession(
            session, tenant, _now(), dict(metadata or {}), kernel_name, origin=origin, recorder=recorder
        )
        observe(managed, self.metrics)
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

    async def delete(self, tenant: str, session_id: str, keep_notebook: bool = True) -> None:
        """Forget the session and remove its container. The removal is shielded: a cancelled
        caller (a culler stopped mid-way, a client gone) never leaves a container behind,
        and :meth:`shutdown_all` waits for removals still under way."""
        managed = self.get(tenant, session_id)
        self._sessions.pop(session_id, None)
        task = asyncio.create_task(managed.session.shutdown())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)
        if not keep_notebook and managed.recorder is not None:
            managed.recorder.delete()

    def __len__(self) -> int:
        return len(self._sessions)

    async def cull(self) -> list[str]:
        """Delete sessions idle longer than ``idle_timeout`` or older than ``max_lifetime``
        (busy ones are left to finish). Returns the culled ids."""
        now = time.monotonic()
        idle_timeout, max_lifetime = self.settings.idle_timeout, self.settings.max_lifetime
        doomed = [
            m
            for m in self._sessions.values()
            if m.execution_state != "busy"
            and not m.session.busy  # an execution is running or queued, by any door
            and (
                (idle_timeout is not None and now - m.active_mono > idle_timeout)
                or (max_lifetime is not None and now - m.created_mono > max_lifetime)
            )
        ]
        for managed in doomed:
            log.info("culling session", extra={"session": managed.id, "tenant": managed.tenant})
            await self.delete(managed.tenant, managed.id)
        return [m.id for m in doomed]

    async def interrupt_busy(self, grace: float) -> None:
        """Interrupt every running execution and give them ``grace`` seconds to return."""
        busy = [m for m in self._sessions.values() if m.execution_state == "busy"]
        await asyncio.gather(*(m.session.interrupt() for m in busy), return_exceptions=True)
        if busy:
            await asyncio.wait([asyncio.create_task(m.session.wait_idle()) for m in busy], timeout=grace)

    async def shutdown_all(self) -> None:
        sessions = list(self._sessions.values())
        self._sessions.clear()
        pool_closed = self.pool.close() if self.pool else asyncio.sleep(0)
        await asyncio.gather(
            *(s.session.shutdown() for s in sessions), *self._closing, pool_closed, return_exceptions=True
        )
