"""Sessions the gateway owns, indexed by session id and kernel id, scoped by tenant.

A Jupyter "kernel" started through /api/kernels and an agent "session" started through
/api/sessions are the same thing here: a :class:`KernelSession`. Lookups take the caller's
tenant, and another tenant's session is reported exactly like a missing one.

Every session is written to the session catalog (kernels/durable/store.py) before it is handed
out, kept current by a catalog observer (session_observers.py) and removed from it when it is
deleted, so a later gateway process can adopt it (gateway/adoption.py). A recorded sandbox that
died while no gateway was attached stays listed as a :class:`LostSession` (state ``lost``, with
the reason) until its tenant deletes it: its work is gone, and that must be said, not hidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from sandkernel.errors import (
    KernelNotFoundError,
    SandkernelError,
)
from sandkernel.gateway.managed import (
    LostSession,
    ManagedSession,
    PausedSession,
    TooManySessionsError,
    now_iso,
)
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.session_metadata import checked_metadata
from sandkernel.gateway.session_observers import CatalogWriter
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.wiring import SessionWiring
from sandkernel.kernels.durable.store import SessionStore
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.catalog import ProfileCatalog
from sandkernel.kernels.lifecycle.pool import WarmPool
from sandkernel.kernels.model.profiles import Profile, Runtime
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord, SandboxState
from sandkernel.kernels.sandbox.cpu_groups import group_for
from sandkernel.kernels.sandbox.kernelspec import kernel_name_for
from sandkernel.kernels.sandbox.memory_checkpoint import SavedMemory
from sandkernel.kernels.sandbox.workspace_disk import KeptWorkspace
from sandkernel.notebooks.recorder import TranscriptRecorder, notebook_path_for

if TYPE_CHECKING:
    from sandkernel.gateway.controls import SessionControls

log = logging.getLogger(__name__)


class Snapshots(Protocol):
    """What the registry asks of the gateway's snapshots (gateway/snapshots.py's SnapshotManager,
    which sits above it: named here by what is used, so the registry imports nothing of it)."""

    async def settled(self, session_id: str, tenant: str | None = None) -> None: ...

    async def pause(self, managed: ManagedSession, door: str) -> dict[str, Any]: ...

    async def resume(self, tenant: str, session_id: str, door: str) -> dict[str, Any]: ...

    async def forget(self, session_id: str) -> None: ...

    async def expire(self) -> list[str]: ...

    async def checkpoint(self, managed: ManagedSession) -> Any: ...


class ClusterCatalog(Protocol):
    """The shared catalog's session reservations (gateway/cluster/catalog.py)."""

    async def reserve(self, tenant: str, limit: int | None, session_id: str) -> None: ...

    async def release(self, session_id: str) -> None: ...


class Cluster(Protocol):
    """What the registry asks of the cluster (gateway/cluster/forward.py's ClusterLink, on top of
    one host: the registry never imports it)."""

    @property
    def catalog(self) -> ClusterCatalog: ...


# Idle sessions the culler pauses at once (each pause archives a workspace: disk and CPU).
CULL_PAUSES_AT_ONCE = 4


def starts_savable(settings: GatewaySettings, profile: Profile) -> bool:
    """Whether a sandbox of ``profile`` starts savable (memory snapshots on, as resolved at start): gVisor, no
    network egress (its relay holds a host socket, which gVisor cannot save)."""
    return settings.memory_snapshots == "on" and profile.runtime is Runtime.RUNSC and profile.network is None


class SessionRegistry:
    """Owns every session of the gateway: live ones, and lost ones until they are deleted."""

    def __init__(
        self,
        settings: GatewaySettings,
        catalog: ProfileCatalog | None = None,
        pool: WarmPool | None = None,
        metrics: GatewayMetrics | None = None,
        store: SessionStore | None = None,
        controls: SessionControls | None = None,
        cluster: Cluster | None = None,
        snapshots: Callable[[SessionRegistry], Snapshots] | None = None,
    ) -> None:
        """``settings`` gives the limits (sessions per tenant and in all, idle timeout, lifetime)
        and the notebook directory; ``catalog`` what tenants may ask for (built-in profiles when
        None); ``pool`` the warm sandboxes, if any; ``metrics`` the gateway's counters; ``store``
        the session catalog every session is recorded in (None: sessions are not durable);
        ``controls`` the operator's policy, breakers, accounting and audit (None: none);
        ``cluster`` the other hosts and the shared catalog, when this gateway is one of several;
        ``snapshots`` makes the snapshot manager over this registry (it sits above the registry
        and works on it: pause, resume, fork; None: no snapshots)."""
        self.settings = settings
        self.metrics = metrics or GatewayMetrics()
        self.pool = pool
        self.catalog = catalog or ProfileCatalog.load()
        self.store = store
        self.writer = CatalogWriter(store) if store is not None else None
        self.controls = controls
        self.snapshots = snapshots(self) if snapshots is not None else None
        checkpoint = self.snapshots.checkpoint if self.snapshots is not None else None
        self.wiring = SessionWiring(settings, self.metrics, controls, self.writer, checkpoint)  # observers and gates
        self._sessions: dict[str, ManagedSession] = {}
        self._lost: dict[str, LostSession] = {}
        self._paused: dict[str, PausedSession] = {}
        self._pending: dict[str, int] = {}  # sandboxes being made, by tenant (see reserved)
        self._resuming = 0  # paused sessions being resumed (they count for their tenant already)
        self._idle_pauses: dict[str, asyncio.Task] = {}  # the culler's pauses under way, by session
        self._idle_pause_slots = asyncio.Semaphore(CULL_PAUSES_AT_ONCE)
        self._closing: set[asyncio.Task] = set()
        self._stopping = False
        self._start_slots = asyncio.Semaphore(settings.cold_start_concurrency)
        self._tenant_starts: dict[str, asyncio.Semaphore] = {}  # each token's lane of cold starts
        self.cpu_groups: set[str] = set()  # the tenants' CPU groups used: removed when empty at the stop
        self.cluster = cluster
        if pool is not None:  # the pool grows beyond its floor only into room the sessions leave
            pool.room = self._pool_room

    def _pool_room(self) -> int:
        """How many more sandboxes the pool may start under ``max_sessions_total``."""
        assert self.pool is not None
        return self.settings.max_sessions_total - self._sandboxes() - self.pool.occupying

    @property
    def stopping(self) -> bool:
        """The gateway is shutting down: new requests get 503 (base.py), and executions cut now
        stay recorded as running (the next gateway settles them)."""
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value
        if self.writer is not None:
            self.writer.stopping = value

    def _count(self, tenant: str) -> int:
        """A tenant's sessions: live, lost (their workspace is kept until deleted) and starting."""
        live = sum(1 for s in self._sessions.values() if s.tenant == tenant)
        lost = sum(1 for s in self._lost.values() if s.tenant == tenant)
        paused = sum(1 for s in self._paused.values() if s.tenant == tenant)
        return live + lost + paused + self._pending.get(tenant, 0)

    def check_room(self, tenant: str, count: int = 1, profile: Profile | None = None) -> None:
        """TooManySessionsError unless ``count`` more live sessions (of ``profile``, if known) fit
        the tenant's limit and the gateway's (a resume needs room in the gateway's, not in the
        tenant's: it was counted)."""
        if self._count(tenant) + count > self.settings.max_sessions:
            raise TooManySessionsError(
                f"session limit reached ({self.settings.max_sessions} per token); delete a session first"
            )
        self.check_gateway_room(count, profile)

    def _sandboxes(self) -> int:
        """Sessions counted toward ``max_sessions_total`` apart from the pool: live, lost and
        starting (paused ones being resumed included: they hold no sandbox until then)."""
        return len(self._sessions) + len(self._lost) + sum(self._pending.values()) + self._resuming

    @contextlib.asynccontextmanager
    async def reserved(
        self, tenant: str, count: int = 1, profile: Profile | None = None, *, counted: bool = False
    ) -> AsyncIterator[None]:
        """Hold room for ``count`` new sandboxes of ``tenant`` while the block makes them: every
        path that makes one (create, fork, resume, rewind, take-over) goes through here. The
        check and the count happen with no await between them, so concurrent calls cannot all
        pass one check; in a cluster each is also reserved in the shared catalog (atomically
        there) before anything starts. Released when the block ends: by then what it made is
        live (and recorded), or failed. ``counted``: the session already counts against the
        tenant's limit (a paused one resuming): only the gateway's total is held."""
        if counted:
            self.check_gateway_room(count, profile)
            self._resuming += count
        else:
            self.check_room(tenant, count, profile)
            self._pending[tenant] = self._pending.get(tenant, 0) + count
        reservations: list[str] = []
        try:
            if self.cluster is not None and not counted:
                for _ in range(count):
                    reservation = uuid.uuid4().hex
                    await self.cluster.catalog.reserve(tenant, self.settings.max_sessions, reservation)
                    reservations.append(reservation)
            yield
        finally:
            try:
                for reservation in reservations:  # its record counts there now (or it failed)
                    await asyncio.shield(self._release(reservation))  # (one not released expires)
            finally:
                # Last, with no await after it: the caller adds what it made before anything runs.
                if counted:
                    self._resuming -= count
                else:
                    self._pending[tenant] -= count

    def load(self) -> tuple[int, int]:
        """(sessions held, room for more) as this host tells the cluster at each heartbeat: room
        under ``max_sessions_total`` less the sandboxes held and the pool's floor (ready pooled
        sandboxes are room: a session takes one)."""
        held = self._sandboxes()
        starting_floor = max(0, self.pool.size - len(self.pool)) if self.pool is not None else 0
        return held, max(0, self.settings.max_sessions_total - held - starting_floor)

    def check_gateway_room(self, count: int = 1, profile: Profile | None = None) -> None:
        """TooManySessionsError unless ``count`` more sessions (of ``profile``, if known) fit
        ``max_sessions_total``. Pooled sandboxes count toward it: the pool's floor always (it
        refills to it), what it grew beyond the floor while it holds it, less the ready ones these
        sessions will take, and surplus ones still being removed; those beyond the floor (ready or
        starting) give way to a session that needs their room, but only when that makes it fit:
        a refused session costs the pool nothing."""
        pool = self.pool
        over = self._sandboxes() + count - self.settings.max_sessions_total
        if pool is not None:
            taken = min(count, len(pool)) if profile is not None and pool.matches(profile) else 0
            over += max(pool.size, pool.held - taken) + pool.removing
            if 0 < over <= pool.held - taken - pool.size:  # what releasing can take off the reserve
                over -= pool.release_surplus(over)
        if over > 0:
            raise TooManySessionsError(
                f"the gateway is at its limit of {self.settings.max_sessions_total} sessions; try again later"
            )

    async def create(
        self,
        tenant: str,
        profile: str | None = None,
        limits: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        origin: str = "session_api",
    ) -> ManagedSession:
        """Start a session for ``tenant``: the named profile with the ``limits`` the tenant asked
        for, checked against the operator's catalog (ConfigError / SettingNotPermittedError).
        It is recorded in the session catalog before it is returned (a StoreError removes it)."""
        metadata = checked_metadata(metadata)
        chosen = self.catalog.for_tenant(profile, limits)
        # In a cluster the tenant's limit counts its sessions on every host: the reservation
        # holds its place there too until this session's record is written.
        async with self.reserved(tenant, profile=chosen):
            session = await self.pool.acquire() if self.pool is not None and self.pool.matches(chosen) else None
            pooled = session is not None
            session_id = session.id if session else uuid.uuid4().hex
            recorder = TranscriptRecorder(
                notebook_path_for(session_id, self.settings.notebook_dir),
                {"tenant": tenant, "client_metadata": metadata, "warm_pool": pooled},
            )
            if session is None:
                session = await self.cold_start(chosen, session_id, tenant)
            await self.wiring.transcript(session, recorder)
            kernel_name = kernel_name_for(session.profile.runtime)
            managed = ManagedSession(
                session, tenant, now_iso(), metadata, kernel_name, origin=origin, recorder=recorder
            )
            await self.record(managed)
        self.wiring.attach(managed)
        self._sessions[session.id] = managed
        log.info("session created", extra={"session": session.id, "tenant": tenant})
        managed.audit_record(
            "session_created",
            door=origin,
            profile=profile or "default",
            runtime=session.profile.runtime.value,
            warm_pool=pooled,
        )
        return managed

    async def _release(self, reservation: str) -> None:
        """Give back a create's reservation (its record now counts, or the create failed); one
        that cannot be given back now expires by itself."""
        assert self.cluster is not None
        try:
            await self.cluster.catalog.release(reservation)
        except Exception as err:
            log.warning("could not release a session reservation (it expires by itself): %s", err)

    async def cold_start(
        self,
        profile: Profile,
        session_id: str,
        tenant: str,
        restore: SavedMemory | None = None,
        kept: KeptWorkspace | None = None,
    ) -> KernelSession:
        """Start a sandbox for ``tenant`` (none was waiting in the pool), through the start
        breaker if any, in the tenant's CPU group (kernels/sandbox/cpu_groups.py: tenants share a
        busy host's CPU by tenant, whatever the number of sandboxes each holds).

        At most ``tenant_cold_start_concurrency`` of one tenant's run at once, and at most
        ``cold_start_concurrency`` in all, the rest queued first come first served:
        on a host whose cores a burst saturates, starts sharing the cores all end together, at
        the end of the burst; taken in turn, the first ones end early and the last no later.
        The time queued here is not a start's (the breaker times the start only). Surplus pooled
        sandboxes that gave their room to sessions are gone first (for every caller: create,
        resume, fork), so the gateway never holds more containers than ``max_sessions_total``.
        ``restore``: a saved kernel (kernels/snapshots/memory.py) that carries on in the sandbox;
        ``kept``: a paused session's workspace disk, checked and copied for this start
        (kernels/snapshots/disk.py), its /workspace."""
        if self.pool is not None:
            await self.pool.removals_done()
        cpu_group = await asyncio.to_thread(group_for, tenant)  # it checks the state dir on disk
        self.cpu_groups.add(cpu_group)
        lane = self._tenant_starts.setdefault(tenant, asyncio.Semaphore(self.settings.tenant_cold_start_concurrency))
        async with lane, self._start_slots:  # its own lane first: a tenant's queue holds no global slot
            start = functools.partial(
                KernelSession.start,
                profile=profile,
                session_id=session_id,
                cpu_group=cpu_group,
                savable=self.savable(profile),
                restore=restore,
                kept=kept,
            )
            if self.controls is None:
                return await start()
            return await self.controls.start_breaker.guard(start)

    def savable(self, profile: Profile) -> bool:
        return starts_savable(self.settings, profile)

    async def record(self, managed: ManagedSession) -> None:
        """Write a new session to the catalog (replacing its pool record, if it was pooled);
        a failure removes the session: one that a restart would lose is not handed out."""
        if self.store is None:
            return
        record = SandboxRecord(
            managed.id,
            SandboxKind.SESSION,
            managed.session.durable_state(),
            tenant=managed.tenant,
            gateway=managed.gateway_record(),
        )
        try:
            await self.store.put(record)
        except BaseException:
            await asyncio.shield(managed.session.shutdown())
            raise

    def add_adopted(self, managed: ManagedSession) -> None:
        """A session a previous gateway process made, adopted at start-up (gateway/adoption.py);
        its CPU group is this process's to remove once empty, as for the groups it starts in."""
        self.wiring.attach(managed)
        self._sessions[managed.id] = managed
        if managed.session.cpu_group is not None:
            self.cpu_groups.add(managed.session.cpu_group)

    def add_live(self, managed: ManagedSession) -> None:
        """A session made or brought back by a snapshot (a resume, a fork), observed and recorded."""
        self.wiring.attach(managed)
        self._sessions[managed.id] = managed
        self._paused.pop(managed.id, None)

    def take_live(self, session_id: str) -> ManagedSession | None:
        """Stop serving a live session (it is being paused or rewound) without closing it."""
        return self._sessions.pop(session_id, None)

    async def finish(self, work: Awaitable[Any]) -> Any:
        """Run ``work`` to its end even if the caller is cancelled (a culler stopped, a client
        gone), and make the gateway's stop wait for it: a container being removed or a session
        being paused is never left half done."""
        return await asyncio.shield(self._tracked(work))

    def finish_later(self, work: Awaitable[Any]) -> None:
        """Run ``work`` without waiting for it; the gateway's stop still does (see :meth:`finish`).
        Its failure is logged."""
        self._tracked(work).add_done_callback(_log_failure)

    def _tracked(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        """``work`` as a task that the gateway's stop waits for."""
        task = asyncio.ensure_future(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    async def settled(self, session_id: str, tenant: str | None = None) -> None:
        """Wait until no pause, resume, fork or rewind of the session is under way (while one is,
        the session is between live and paused)."""
        if self.snapshots is not None:
            await self.snapshots.settled(session_id, tenant)

    def add_paused(self, paused: PausedSession) -> None:
        """A session paused to disk (by this process, or recorded paused by an earlier one)."""
        self._paused[paused.id] = paused

    def paused(self, tenant: str, session_id: str) -> PausedSession | None:
        """The tenant's paused session of that id, if it is paused."""
        found = self._paused.get(session_id)
        return found if found is not None and found.tenant == tenant else None

    def live_ids(self) -> set[str]:
        return set(self._sessions)

    def paused_sessions(self) -> list[PausedSession]:
        return list(self._paused.values())

    async def for_kernel_call(self, tenant: str, session_id: str) -> ManagedSession:
        """The tenant's live session once no pause, resume, fork or rewind of it is under way:
        what an interrupt or a restart takes, so it never lands in the middle of a snapshot (after
        a rewind it reaches the new kernel; a session that was paused answers 409)."""
        await self.settled(session_id, tenant)
        return self.get(tenant, session_id)

    async def live(self, tenant: str, session_id: str, door: str) -> ManagedSession:
        """The tenant's live session, resumed first if it is paused: what every call that runs
        code or touches files takes, so an agent never has to know its session was paused."""
        await self.settled(session_id, tenant)
        if self.paused(tenant, session_id) is not None and self.snapshots is not None:
            await self.snapshots.resume(tenant, session_id, door)
        return self.get(tenant, session_id)

    def add_lost(self, lost: LostSession) -> None:
        """A recorded session whose sandbox could not be adopted: listed as ``lost`` until deleted."""
        self._lost[lost.id] = lost

    def get(self, tenant: str, session_id: str) -> ManagedSession:
        """The tenant's live session (404 for another tenant's or none; 410 for a lost one)."""
        managed = self._sessions.get(session_id)
        if managed is not None and managed.tenant == tenant:
            return managed
        lost = self._lost.get(session_id)
        if lost is not None and lost.tenant == tenant:
            raise lost.error()
        paused = self.paused(tenant, session_id)
        if paused is not None:
            raise paused.error()
        raise KernelNotFoundError(f"no session {session_id!r}")

    def holds(self, tenant: str, session_id: str) -> bool:
        """Whether this host has the tenant's session, live, paused or lost (what :meth:`find`
        finds): cluster routing serves it here, else asks where it is."""
        for table in (self._sessions, self._lost, self._paused):
            found = table.get(session_id)
            if found is not None and found.tenant == tenant:
                return True
        return False

    def find(self, tenant: str, session_id: str) -> ManagedSession | LostSession | PausedSession:
        """The tenant's session, live, paused or lost (what GET and DELETE of a session see)."""
        lost = self._lost.get(session_id)
        if lost is not None and lost.tenant == tenant:
            return lost
        paused = self.paused(tenant, session_id)
        if paused is not None:
            return paused
        return self.get(tenant, session_id)

    def by_kernel(self, tenant: str, kernel_id: str) -> ManagedSession:
        # A session's kernel id stays when the ladder replaces its container; a resume or a
        # rewind starts a new one: look it up live.
        # Lost sessions have no kernel: the kernel API does not know them (JupyterLab then offers
        # to start another kernel, which is what the user has to do).
        for managed in self._sessions.values():
            if managed.session.kernel_id == kernel_id and managed.tenant == tenant:
                return managed
        raise KernelNotFoundError(f"no kernel {kernel_id!r}")

    def list(self, tenant: str) -> list[ManagedSession]:
        """The tenant's live sessions (the kernel API's listing)."""
        return [s for s in self._sessions.values() if s.tenant == tenant]

    def models(self, tenant: str) -> list[dict[str, Any]]:
        """The session models of the tenant's sessions, live and lost (GET /api/sessions)."""
        models = [s.session_model() for s in self.list(tenant)]
        models += [s.session_model() for s in self._lost.values() if s.tenant == tenant]
        models += [s.session_model() for s in self._paused.values() if s.tenant == tenant]
        return models

    async def delete(self, tenant: str, session_id: str, keep_notebook: bool = True, reason: str = "deleted") -> None:
        """Forget the session, remove its container and its catalog record. The removal is
        shielded: a cancelled caller (a culler stopped mid-way, a client gone) never leaves a
        container behind, and :meth:`shutdown_all` waits for removals still under way. A lost
        session's leftovers are discarded (a refused one's are left for the operator); its
        transcript is kept. ``reason`` goes in the audit record (deleted, culled, ...)."""
        found = self.find(tenant, session_id)
        if self.controls is not None and self.controls.audit is not None:
            self.controls.audit.record("session_deleted", tenant=tenant, session=session_id, reason=reason)
        if isinstance(found, LostSession):
            self._lost.pop(session_id, None)
            task = asyncio.create_task(self._discard(found))
        elif isinstance(found, PausedSession):
            self._paused.pop(session_id, None)
            task = asyncio.create_task(self._drop_paused(found))
        else:
            self._sessions.pop(session_id, None)
            task = asyncio.create_task(self._remove(found))
        await self.finish(task)
        if not keep_notebook and isinstance(found, ManagedSession) and found.recorder is not None:
            found.recorder.delete()
        elif not keep_notebook and isinstance(found, PausedSession):
            transcript = found.record.gateway.get("transcript")
            if isinstance(transcript, str):
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(os.unlink, transcript)

    async def declare_lost(self) -> int:
        """After this host was marked down by the cluster (it stopped heartbeating: frozen, cut
        off), let go of the live sessions the catalog now records as lost: their tenants were
        told, through the other hosts, that they are lost, so they are lost here too (noted in
        the transcript, sandbox removed, listed with the reason until deleted), never quietly
        carried on. Returns how many."""
        if self.store is None:
            return 0
        declared = [
            record
            for record in await self.store.load()
            if record.state == SandboxState.LOST and record.session_id in self._sessions
        ]
        # Every one is lost in one step, before any await: a request arriving while the sandboxes
        # are let go gets the 410 that says why, never a 404 for a session it just used.
        letting_go: list[tuple[ManagedSession, str]] = []
        for record in declared:
            reason = record.lost_reason or "the cluster declared it lost"
            letting_go.append((self._sessions.pop(record.session_id), reason))
            self.add_lost(LostSession(record, reason))
        for managed, reason in letting_go:
            with contextlib.suppress(Exception):
                await managed.session.note(f"**session lost:** {reason}; the cluster declared it lost")
            await managed.session.shutdown()
            log.warning("session declared lost by the cluster", extra={"session": managed.id})
        return len(declared)

    async def _remove(self, managed: ManagedSession) -> None:
        await managed.session.shutdown()
        if self.snapshots is not None:  # its per-cell checkpoints, if it kept any
            await self.snapshots.forget(managed.id)
        await self.forget_record(managed.id)

    async def _drop_paused(self, paused: PausedSession) -> None:
        if self.snapshots is not None:
            await self.snapshots.forget(paused.id)
        await self.forget_record(paused.id)

    async def _discard(self, lost: LostSession) -> None:
        if lost.refused:
            log.warning(
                "session deleted; its sandbox was refused at adoption and is left for the operator "
                "(container %s, runtime dir %s)",
                lost.record.kernel.get("container_id"),
                lost.record.kernel.get("runtime_dir"),
                extra={"session": lost.id, "tenant": lost.tenant},
            )
        else:
            await KernelSession.discard(lost.id, lost.record.kernel)
        await self.forget_record(lost.id)

    async def forget_record(self, session_id: str) -> None:
        if self.store is None:
            return
        try:
            await self.store.remove(session_id)
        except Exception as err:  # the sandbox is gone; a stale record is reported lost next start
            log.warning("could not remove the session's catalog record: %s", err, extra={"session": session_id})

    def __len__(self) -> int:
        return len(self._sessions)

    def breakers_health(self) -> dict[str, Any]:
        """The breakers for /api/health: the start breaker's state and how many live sessions
        their own breaker has quarantined."""
        starts = self.controls.start_breaker.health() if self.controls is not None else None
        quarantined = sum(1 for m in self._sessions.values() if m.breaker is not None and m.breaker.quarantined)
        return {"sandbox_starts": starts, "quarantined_sessions": quarantined}

    async def cull(self) -> list[str]:
        """Pause (``idle_action`` pause) or delete sessions idle longer than ``idle_timeout``,
        delete those older than ``max_lifetime`` (busy ones are left to finish) and paused ones
        past ``paused_ttl``. Returns the ids acted on. A session whose pause fails (its tenant's
        snapshot quota is full) is deleted, and the audit says why. Lost sessions are not culled:
        they stay listed until their tenant has seen and deleted them."""
        now = time.monotonic()
        idle_timeout, max_lifetime = self.settings.idle_timeout, self.settings.max_lifetime
        culled = []
        to_pause: list[ManagedSession] = []
        for managed in list(self._sessions.values()):
            if managed.execution_state == "busy" or managed.session.busy:  # running or queued, by any door
                continue
            if managed.id in self._idle_pauses:  # its pause is under way
                continue
            too_old = max_lifetime is not None and now - managed.created_mono > max_lifetime
            idle = idle_timeout is not None and now - managed.active_mono > idle_timeout
            if not (too_old or idle):
                continue
            culled.append(managed.id)
            if idle and not too_old and self.settings.idle_action == "pause" and self.snapshots is not None:
                to_pause.append(managed)
                continue
            await self._cull(managed, "culled")
        # In the background, a few at a time, each within --pause-timeout: one session whose
        # pause is slow (a sandbox can stop its archiver) holds up neither the others nor the
        # culler's next round (which skips the sessions still being paused).
        for managed in to_pause:
            if managed.id not in self._idle_pauses:
                task = asyncio.create_task(self._pause_idle(managed), name=f"sandkernel-idle-pause-{managed.id}")
                self._idle_pauses[managed.id] = task
                task.add_done_callback(lambda _, sid=managed.id: self._idle_pauses.pop(sid, None))
        if self.snapshots is not None:
            culled += await self.snapshots.expire()
        return culled

    async def _pause_idle(self, managed: ManagedSession) -> None:
        """Pause an idle session; one whose pause fails (its tenant's snapshot quota is full, its
        archive passed --pause-timeout) is deleted, and the audit says why."""
        assert self.snapshots is not None
        async with self._idle_pause_slots:
            if managed.id not in self._sessions or managed.execution_state == "busy" or managed.session.busy:
                return  # deleted meanwhile, or woken up by a call
            try:
                await self.snapshots.pause(managed, door="idle")
                return
            except SandkernelError as err:
                log.warning("pausing an idle session failed (%s); deleting it", err, extra={"session": managed.id})
                reason = f"culled: its pause failed ({err})"
            await self._cull(managed, reason)

    async def _cull(self, managed: ManagedSession, reason: str) -> None:
        log.info("culling session", extra={"session": managed.id, "tenant": managed.tenant})
        with contextlib.suppress(KernelNotFoundError):
            await self.delete(managed.tenant, managed.id, reason=reason)

    # -- stopping ---------------------------------------------------------------------------

    async def interrupt_busy(self, grace: float) -> None:
        """Interrupt every running execution and give them ``grace`` seconds to return."""
        busy = [m for m in self._sessions.values() if m.execution_state == "busy"]
        await asyncio.gather(*(m.session.interrupt() for m in busy), return_exceptions=True)
        if busy:
            await asyncio.wait([asyncio.create_task(m.session.wait_idle()) for m in busy], timeout=grace)

    async def settle(self, grace: float) -> list[ManagedSession]:
        """Wait up to ``grace`` seconds for running (and already queued) executions to finish;
        the sessions still busy after it."""
        deadline = time.monotonic() + grace
        while busy := [m for m in self._sessions.values() if m.session.busy]:
            left = deadline - time.monotonic()
            if left <= 0:
                return busy
            waiters = [asyncio.create_task(m.session.wait_idle()) for m in busy]
            _, pending = await asyncio.wait(waiters, timeout=left)
            for waiter in pending:
                waiter.cancel()
        return []

    async def _stop_idle_pauses(self) -> None:
        """A stopping gateway does not wait for the culler's pauses: each is cancelled (its
        archive stops at its next read and is discarded; the session stays as it was)."""
        tasks = list(self._idle_pauses.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def detach_all(self) -> None:
        """Let go of every session, leaving its container running and its record in the catalog
        (with ``gateway.detached_at``), for the next gateway process to adopt."""
        await self._stop_idle_pauses()
        sessions = list(self._sessions.values())
        self._sessions.clear()
        detached_at = now_iso()
        results = await asyncio.gather(*(m.session.detach() for m in sessions), return_exceptions=True)
        for managed, outcome in zip(sessions, results, strict=True):
            if isinstance(outcome, BaseException):
                log.warning("detaching a session failed: %s", outcome, extra={"session": managed.id})
            if self.writer is not None:
                self.writer.update(managed.id, gateway=managed.gateway_record(detached_at=detached_at))
            if managed.recorder is not None:
                await managed.recorder.close()
        if self.pool is not None:
            await self.pool.detach()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def shutdown_all(self) -> None:
        """Remove every session's container and record (``--on-exit delete``): lost ones too,
        except those refused at adoption (left, with their records, for the operator)."""
        await self._stop_idle_pauses()
        sessions = list(self._sessions.values())
        lost = [s for s in self._lost.values() if not s.refused]
        paused = list(self._paused.values())
        self._sessions.clear()
        self._lost.clear()
        self._paused.clear()
        pool_closed = self.pool.close() if self.pool is not None else asyncio.sleep(0)
        await asyncio.gather(
            *(self._remove(s) for s in sessions),
            *(self._discard(s) for s in lost),
            *(self._drop_paused(s) for s in paused),
            *self._closing,
            pool_closed,
            return_exceptions=True,
        )


def _log_failure(task: asyncio.Future[Any]) -> None:
    """A background task's failure, logged (:meth:`SessionRegistry.finish_later`)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("background work failed: %s", task.exception(), exc_info=task.exception())
