"""A paused session of a host that is down, resumed on this one (a snapshot dir the hosts share).

A host that dies takes its live sessions with it (they are ``lost``), but a *paused* session has
nothing on that host but its catalog row: its files and transcript are in its snapshot. When
the hosts share one snapshot dir (NFS mounted on each; the key that signs the snapshots is in
it, so each host's store has the same ``store_id``, which each registers in the catalog), any
other gateway asked for such a session takes it over and serves it as its own paused session:
the request that asked (an execute, a file call, a resume) then resumes it here by replay, as on
the host that paused it.

Taking over is decided in the catalog, never guessed: the row must be paused, its tenant the
caller, its host ``down`` and registered with this host's snapshot store; the snapshot must load
here (signed with the shared key, of this session and tenant) before anything changes; then one
conditional UPDATE moves the row to this host, so of the gateways that try at once exactly one
gets it. The others, and this one's concurrent requests for the same session, wait for that one
and are then forwarded to it (or served here) as usual. A host that comes back later no longer
finds the session among its records; its snapshot sweep keeps what any host records.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol, cast

from sandkernel.errors import SnapshotRejectedError
from sandkernel.gateway.managed import PausedSession, seconds_since

if TYPE_CHECKING:
    from sandkernel.gateway.cluster.forward import ClusterLink
    from sandkernel.gateway.registry import SessionRegistry
    from sandkernel.kernels.model.records import SandboxRecord

# Paused sessions of down hosts looked at per cull: the oldest first, the rest at the next cull.
EXPIRE_BATCH = 100


class TakeoverCatalog(Protocol):
    """What taking over needs of gateway/cluster/catalog.py's ClusterCatalog."""

    async def paused_on_down_host(
        self, session_id: str, tenant: str, snapshot_store: str
    ) -> tuple[SandboxRecord, str] | None: ...

    async def paused_on_down_hosts(self, snapshot_store: str, limit: int) -> list[tuple[SandboxRecord, str]]: ...

    async def take_over_paused(self, session_id: str, tenant: str, from_host: str) -> SandboxRecord | None: ...


log = logging.getLogger(__name__)


async def take_over_paused(registry: SessionRegistry, link: ClusterLink, tenant: str, session_id: str) -> bool:
    """Take over the tenant's session ``session_id`` if it is paused on a down host whose
    snapshots this host can read; True when this host now holds it (serve the request here).
    Concurrent calls for one session share the first one's outcome."""
    pending = link.takeovers.get(session_id)
    if pending is not None:
        return await asyncio.shield(pending)
    task = asyncio.ensure_future(_take_over(registry, link, tenant, session_id))
    link.takeovers[session_id] = task
    # Forgotten when it ends, even if this request went away meanwhile (shielded: it still ends).
    task.add_done_callback(lambda _: link.takeovers.pop(session_id, None))
    return await asyncio.shield(task)


async def _take_over(registry: SessionRegistry, link: ClusterLink, tenant: str, session_id: str) -> bool:
    snapshots = registry.snapshots
    if snapshots is None:
        return False
    catalog = cast("TakeoverCatalog", link.catalog)
    found = await link.ask(
        catalog.paused_on_down_host(session_id, tenant, snapshots.store.store_id), "read the session's record"
    )
    if found is None:
        return False
    record, from_host = found
    try:
        manifest = await snapshots.check_movable(record)
    except SnapshotRejectedError as err:  # not readable here: it waits for its host (503 naming it)
        log.warning(
            "a paused session of a down host cannot be resumed here: %s",
            err,
            extra={"session": session_id, "from_host": from_host},
        )
        return False
    taken = await link.ask(link.catalog.take_over_paused(session_id, tenant, from_host), "take over the paused session")
    if taken is None:  # another gateway took it first, or its host came back
        return False
    await registry.finish(snapshots.moved_here(taken, manifest, from_host))
    return True


async def expire_paused_of_down_hosts(registry: SessionRegistry, link: ClusterLink, ttl: float) -> list[str]:
    """Delete the sessions paused longer than ``ttl`` on hosts that are down and share this
    host's snapshot store: their own host would have expired them (``--paused-ttl``), and with
    it away nobody else does, so their snapshots would fill the shared dir. Each is taken over
    first (one gateway gets it), then deleted as this host's own expired pause is. Their ids."""
    snapshots = registry.snapshots
    if snapshots is None:
        return []
    catalog = cast("TakeoverCatalog", link.catalog)
    try:
        found = await link.ask(
            catalog.paused_on_down_hosts(snapshots.store.store_id, EXPIRE_BATCH), "read paused sessions"
        )
    except Exception as err:  # the next cull tries again
        log.warning("paused sessions of down hosts not expired: %s", err)
        return []
    expired: list[str] = []
    for record, from_host in found:
        if record.tenant is None or seconds_since(record.gateway.get("paused_at")) <= ttl:
            continue
        taken = await link.ask(catalog.take_over_paused(record.session_id, record.tenant, from_host), "expire")
        if taken is None:
            continue
        log.info(
            "paused session of a down host expired",
            extra={"session": taken.session_id, "tenant": taken.tenant, "from_host": from_host},
        )
        registry.add_paused(PausedSession(taken))
        await registry.delete(record.tenant, taken.session_id, reason="paused_ttl")
        expired.append(taken.session_id)
    return expired
