"""Start-up: adopt every sandbox the session catalog holds, before the gateway accepts a request.

A gateway process that stopped (SIGTERM, ``kill -9``, a crash, an upgrade) leaves its sandboxes
running and their records in the catalog. The next process, on the same state dir, adopts them
here: each session gets back its tenant, creation time, metadata, kernel name, origin, idle
clock (a session idle 50 minutes before the restart is culled on time, not given a fresh hour),
its transcript (the same .ipynb, continued) and the gateway's observers; only then does the
session resume (kernels/execution/session.py: the note about the gap, the execution that was in
flight). Pool records go back into the warm pool when its profile still matches.

Why concurrently: each adoption waits on Docker and the kernel's sockets; one after another,
50 sessions would take seconds the gateway cannot serve in. Why sessions that cannot be adopted
are kept: their tenants' work is gone, and a session that silently disappeared would look like a
bug; it is listed as ``lost`` with the reason until its tenant deletes it. A sandbox that is not
what its record says (AdoptionRefusedError) is left exactly as it is, record included, for an
operator to look at.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sandkernel import doors
from sandkernel.errors import AdoptionRefusedError, SandboxLostError, SandkernelError
from sandkernel.gateway.managed import LostSession, ManagedSession, PausedSession, seconds_since
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.traffic import Traffic
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord, SandboxState
from sandkernel.kernels.sandbox.kernelspec import kernel_name_for
from sandkernel.notebooks.recorder import TranscriptRecorder

if TYPE_CHECKING:
    from sandkernel.kernels.durable.store import SessionStore

log = logging.getLogger(__name__)

# Adoptions running at once: each holds a few Docker calls and sockets; the engine's own thread
# pool bounds the Docker side anyway.
MAX_CONCURRENT_ADOPTIONS = 32


@dataclasses.dataclass
class AdoptionReport:
    """What start-up found in the catalog: for the summary line and the tests."""

    adopted: list[str] = dataclasses.field(default_factory=list)
    lost: list[str] = dataclasses.field(default_factory=list)
    paused: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    pooled: list[str] = dataclasses.field(default_factory=list)
    discarded: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"adopted {len(self.adopted)} session(s), {len(self.paused)} paused, {len(self.lost)} lost, "
            f"{len(self.refused)} refused, "
            f"{len(self.pooled)} pooled sandbox(es) back in the pool, {len(self.discarded)} discarded, "
            f"in {self.seconds:.2f}s"
        )


async def adopt_all(registry: SessionRegistry, records: list[SandboxRecord], traffic: Traffic) -> AdoptionReport:
    """Adopt every record concurrently into ``registry`` (and its pool); ``traffic`` holds the
    kernel websockets a settled websocket execute is answered on (gateway/settled_replies.py)."""
    started = time.monotonic()
    report = AdoptionReport()
    limit = asyncio.Semaphore(MAX_CONCURRENT_ADOPTIONS)

    async def one(record: SandboxRecord) -> None:
        async with limit:
            try:
                if record.kind == SandboxKind.POOL:
                    await _adopt_pooled(registry, record, report)
                else:
                    await _adopt_session(registry, record, report, traffic)
            except Exception as err:  # one record must not stop the others; keep it, say so
                log.exception("adopting a recorded sandbox failed", extra={"session": record.session_id})
                registry.add_lost(LostSession(record, f"the gateway could not adopt it ({err})", refused=True))
                report.refused.append(record.session_id)

    await asyncio.gather(*(one(record) for record in records))
    report.seconds = time.monotonic() - started
    return report


async def _adopt_session(
    registry: SessionRegistry, record: SandboxRecord, report: AdoptionReport, traffic: Traffic
) -> None:
    sid, tenant = record.session_id, record.tenant
    if record.state == SandboxState.LOST:  # found lost by an earlier start: say so again
        registry.add_lost(LostSession(record, record.lost_reason or "its sandbox was lost"))
        report.lost.append(sid)
        return
    if record.state == SandboxState.PAUSED:
        await _adopt_paused(registry, record, report)
        return
    try:
        session = await KernelSession.adopt(sid, record.kernel)
    except SandboxLostError as err:
        reason = str(err)
        log.warning("session lost: %s", reason, extra={"session": sid, "tenant": tenant})
        registry.add_lost(LostSession(record, reason))
        await _mark_lost(registry.store, sid, reason)
        report.lost.append(sid)
        return
    except AdoptionRefusedError as err:
        reason = f"the gateway refused to adopt its sandbox, which is not what was recorded ({err}); left alone"
        log.error(
            "ADOPTION REFUSED: %s; the container and the record are left for the operator",
            err,
            extra={"session": sid, "tenant": tenant},
        )
        registry.add_lost(LostSession(record, reason, refused=True))
        report.refused.append(sid)
        return
    managed = await _restore(registry, session, record)
    registry.add_adopted(managed)
    if managed.breaker is not None:  # a quarantine outlives the gateway process, like the session
        managed.breaker.restore(record.gateway.get("quarantined"))
    gateway = record.gateway
    running = record.running or {}
    if running.get("source") == doors.WEBSOCKET and not running.get("silent") and running.get("msg_id"):
        registry.wiring.settle(managed, traffic.websockets, str(running["msg_id"]))
    await session.resume(running=record.running, detached_at=gateway.get("detached_at"))
    if registry.writer is not None:  # no longer detached
        registry.writer.update(sid, gateway=managed.gateway_record())
    log.info(
        "session adopted",
        extra={"session": sid, "tenant": tenant, "running": bool(record.running)},
    )
    report.adopted.append(sid)


async def _adopt_paused(registry: SessionRegistry, record: SandboxRecord, report: AdoptionReport) -> None:
    """A paused session: listed as paused. A pause cut short by a crash left its old sandbox's
    state (``previous``): what is left of that sandbox is removed now (its files are in the snapshot)."""
    previous = record.kernel.pop("previous", None)
    if isinstance(previous, dict):
        try:
            await KernelSession.discard(record.session_id, previous)
        except SandkernelError as err:
            log.warning("removing a paused session's old sandbox failed: %s", err, extra={"session": record.session_id})
        if registry.store is not None:
            await registry.store.update(record.session_id, kernel=record.kernel)
    registry.add_paused(PausedSession(record))
    report.paused.append(record.session_id)


async def _restore(registry: SessionRegistry, session: KernelSession, record: SandboxRecord) -> ManagedSession:
    """The registry entry the previous process had, its transcript reopened and its clocks
    carried over (idle time and age count from before the restart)."""
    recorder = None
    transcript = record.gateway.get("transcript")
    if isinstance(transcript, str):
        recorder = await asyncio.to_thread(TranscriptRecorder.reopen, Path(transcript))
        await registry.wiring.transcript(session, recorder)
    managed = managed_from_record(session, record, recorder)
    if isinstance(record.gateway.get("last_activity"), str):
        managed.last_activity = record.gateway["last_activity"]
        managed.active_mono = time.monotonic() - seconds_since(managed.last_activity)
    return managed


def managed_from_record(
    session: KernelSession, record: SandboxRecord, recorder: TranscriptRecorder | None
) -> ManagedSession:
    """The registry entry a catalog record describes, for a sandbox of it (adopted, or started
    anew by a resume): tenant, creation time and age, metadata, kernel name, origin, transcript."""
    gateway = record.gateway
    metadata = gateway.get("metadata") if isinstance(gateway.get("metadata"), dict) else {}
    managed = ManagedSession(
        session,
        record.tenant or "",
        gateway.get("created") or "",
        dict(metadata),
        gateway.get("kernel_name") or kernel_name_for(session.profile.runtime),
        origin=gateway.get("origin") or "session_api",
        recorder=recorder,
        lifetime_from=gateway.get("lifetime_from") if isinstance(gateway.get("lifetime_from"), str) else None,
    )
    managed.created_mono = time.monotonic() - seconds_since(managed.lifetime_from or managed.created)
    return managed


async def _mark_lost(store: SessionStore | None, session_id: str, reason: str) -> None:
    """Record the loss, so later starts list it with the same reason without trying again."""
    if store is None:
        return
    try:
        await store.update(session_id, state=SandboxState.LOST.value, lost_reason=reason)
    except SandkernelError as err:
        log.warning("could not record a lost session: %s", err, extra={"session": session_id})


async def _adopt_pooled(registry: SessionRegistry, record: SandboxRecord, report: AdoptionReport) -> None:
    """A warm sandbox nobody used: back into the pool if it still fits, else removed."""
    sid = record.session_id
    pool = registry.pool
    try:
        session = await KernelSession.adopt(sid, record.kernel)
    except SandboxLostError as err:
        log.info("pooled sandbox lost (%s); discarding it", err, extra={"session": sid})
        await _discard(registry, record)
        report.discarded.append(sid)
        return
    except AdoptionRefusedError as err:
        log.error("ADOPTION REFUSED for a pooled sandbox: %s; left for the operator", err, extra={"session": sid})
        report.refused.append(sid)
        return
    if pool is not None and pool.matches(session.profile) and pool.adopt(session):
        report.pooled.append(sid)
        return
    await session.shutdown()
    await registry.forget_record(sid)
    report.discarded.append(sid)


async def _discard(registry: SessionRegistry, record: SandboxRecord) -> None:
    try:
        await KernelSession.discard(record.session_id, record.kernel)
    except SandkernelError as err:
        log.warning("discarding a lost pooled sandbox failed: %s", err, extra={"session": record.session_id})
    await registry.forget_record(record.session_id)
