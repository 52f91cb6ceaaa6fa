"""The cluster's shared catalog: which hosts are up, which host holds each session, and each
tenant's sessions counted across all hosts. PostgreSQL is the only coordinator.

:class:`ClusterCatalog` works on the tables that ``gateway/cluster/pg_schema.py`` creates, through
the same connection pool as this host's :class:`~sandkernel.gateway.cluster.postgres.PostgresStore`
(one pool per gateway). Every decision that two gateways could race on is one transaction:

- **Hosts** (``hosts``): a gateway registers with its advertised URL, runtimes and capacity, then
  heartbeats its session count and free room. Times are the database server's (``now()``), so
  hosts' clocks never have to agree. ``leave`` marks a graceful stop ('stopping': placed on no more).
- **Host down** (:meth:`mark_down_stale`): any gateway may notice a host whose heartbeat is older
  than ``host_down_after``; one statement marks it 'down' and turns its running sessions into
  ``lost`` with the reason "host <id> stopped answering at <its last heartbeat>". Paused sessions
  stay paused (a host sharing the down host's snapshot store may take one over:
  :meth:`take_over_paused`); nothing is re-created empty. Two
  gateways doing it at once change nothing twice (the second finds the host already down). A host
  that comes back is 'up' again at its next register or heartbeat; its lost rows stay lost.
- **Placement** (:meth:`place`): the 'up' host with the most free room that has the runtime. The
  chosen host's ``free`` is taken down by one at once, so a burst of creates spreads over the
  hosts instead of all landing on the one that was most free at the last heartbeat. The placement
  is also recorded (``placements``) until the create reaches that host (its :meth:`reserve`) or
  :data:`PLACEMENT_SECONDS` pass: a heartbeat in between reports a count without it, so the
  heartbeat's room is taken down by the placements still on their way (without that, a host near
  capacity was overbooked by the creates forwarded to it while it beat).
- **Tenants' limits** (:meth:`reserve`): the tenant's sessions (every state: a lost or paused
  session counts until deleted, as on one host) plus its reservations are counted inside a
  transaction holding ``pg_advisory_xact_lock(hashtext('sk-tenant:' || tenant))``, so concurrent
  creates on any hosts cannot pass the limit together. The reservation holds the place until the
  session's record is put (``PostgresStore.put`` removes it in the same transaction), it is
  released (:meth:`release`, a failed create), or it expires.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandkernel.gateway.cluster.postgres import RECORD_COLUMNS, PostgresStore
from sandkernel.gateway.managed import TooManySessionsError
from sandkernel.kernels.durable.store import StoreError
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord, SandboxState

if TYPE_CHECKING:
    from psycopg import AsyncConnection

log = logging.getLogger(__name__)

RESERVATION_SECONDS = (
    600.0  # longer than any create takes (image start, adoption); a crashed creator's place comes back
)
# How long a placement counts against its host's room while its create is on the way there (a
# forward: connect within 5 s, then the host's reserve). One that never arrives (the forward
# failed, the host refused it) gives its room back after this.
PLACEMENT_SECONDS = 30.0
HOST_STATUSES = frozenset({"up", "down", "stopping"})
# A host that said it is stopping (a restart, a rolling upgrade) is given at least this long
# before it is marked down and its sessions lost: its sandboxes keep running meanwhile, and the
# next gateway on it adopts them (durable sessions). One that crashed gets only host_down_after.
RESTART_GRACE_SECONDS = 120.0
# Placements tried before "no host has room": a placement that waited on a host that filled up
# meanwhile finds no row and tries again (see ClusterCatalog.place).
PLACE_ATTEMPTS = 3
_HOST_COLUMNS = "host_id, url, runtimes, capacity, sessions, free, status, heartbeat_at"
# A create reached its host: let go of the oldest placement on the way to it (SKIP LOCKED: two
# creates arriving at once let go of two).
_ARRIVED = (
    "DELETE FROM placements WHERE id = (SELECT id FROM placements WHERE host_id = %s AND expires_at > now() "
    "ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
)
_S_RECORD_COLUMNS = ", ".join(f"s.{name.strip()}" for name in RECORD_COLUMNS.split(","))
_H_HOST_COLUMNS = ", ".join(f"h.{name.strip()}" for name in _HOST_COLUMNS.split(","))


@dataclass(frozen=True)
class HostInfo:
    """One gateway of the cluster as the catalog last heard of it. ``heartbeat_at`` is the
    database server's clock; ``free`` is the host's own count at its last heartbeat, less the
    sessions placed on it whose create had not reached it by then and those placed since."""

    host_id: str
    url: str
    runtimes: tuple[str, ...]
    capacity: int
    sessions: int
    free: int
    status: str  # "up" | "down" | "stopping"
    heartbeat_at: dt.datetime

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> HostInfo:
        host_id, url, runtimes, capacity, sessions, free, status, heartbeat_at = row[:8]
        return cls(host_id, url, tuple(runtimes), capacity, sessions, free, status, heartbeat_at)


class ClusterCatalog:
    """The cluster's tables for host ``host_id``; see the module docstring. Every call is one
    transaction; errors are the store's (:class:`StoreError`, ``CatalogUnavailableError`` 503 when
    PostgreSQL cannot be reached) and :class:`TooManySessionsError` (429) from :meth:`reserve`."""

    def __init__(
        self,
        pool_or_store: PostgresStore,
        host_id: str,
        *,
        reservation_seconds: float = RESERVATION_SECONDS,
        placement_seconds: float = PLACEMENT_SECONDS,
    ) -> None:
        if not isinstance(pool_or_store, PostgresStore):
            raise TypeError("ClusterCatalog shares an open PostgresStore's pool: pass the store")
        self.store = pool_or_store
        self.host_id = host_id
        self.reservation_seconds = reservation_seconds
        self.placement_seconds = placement_seconds

    # -- this host -----------------------------------------------------------------------------

    async def register(
        self, url: str, runtimes: Sequence[str], capacity: int, snapshot_store: str | None = None
    ) -> None:
        """Record this host as 'up' at ``url`` (its advertised URL) with the runtimes its engine
        has, its capacity (max sessions in all) and its snapshot store's id (hosts with the same
        one share their snapshots); a host already there (a restart) is updated."""
        runtimes = list(runtimes)
        if not runtimes or not all(isinstance(r, str) and r for r in runtimes):
            raise ValueError(f"a host needs at least one runtime, not {runtimes!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"a host's capacity is a number of sessions, not {capacity!r}")
        from sandkernel import __version__

        sql = (
            "INSERT INTO hosts (host_id, url, runtimes, capacity, sessions, free, status, started_at, heartbeat_at, "
            "version, snapshot_store) VALUES (%s, %s, %s, %s, 0, %s, 'up', now(), now(), %s, %s) "
            "ON CONFLICT (host_id) DO UPDATE SET "
            "url = EXCLUDED.url, runtimes = EXCLUDED.runtimes, capacity = EXCLUDED.capacity, free = EXCLUDED.free, "
            "sessions = 0, status = 'up', started_at = now(), heartbeat_at = now(), version = EXCLUDED.version, "
            "snapshot_store = EXCLUDED.snapshot_store RETURNING (SELECT status FROM hosts WHERE host_id = %s)"
        )
        params = (self.host_id, url, runtimes, capacity, capacity, __version__, snapshot_store, self.host_id)
        previous = await self._row(sql, params, what="registering this host in")
        self._note_return(previous)

    async def heartbeat(self, sessions: int, free: int) -> bool:
        """This host is alive with ``sessions`` sessions and room for ``free`` more (the server's
        clock times it), less the sessions placed here whose create has not arrived yet (they are
        in neither count). A host marked down meanwhile is 'up' again (its lost sessions stay
        lost): returns True then, so the gateway lets go of the sessions the cluster declared lost.
        StoreError if the host is not registered (its row was deleted: register again)."""
        # The row is locked by its own statement first (the status before), then updated: one
        # lock a statement, so a heartbeat and placements on this host never deadlock.
        sql = (
            "UPDATE hosts SET sessions = %(sessions)s + p.coming, free = greatest(0, %(free)s - p.coming), "
            "heartbeat_at = now(), status = 'up' "
            "FROM (SELECT count(*)::int AS coming FROM placements WHERE host_id = %(me)s AND expires_at > now()) AS p "
            "WHERE host_id = %(me)s"
        )
        params = {"sessions": sessions, "free": free, "me": self.host_id}

        async def work(conn: AsyncConnection) -> tuple[Any, ...] | None:
            before = await (
                await conn.execute("SELECT status FROM hosts WHERE host_id = %s FOR UPDATE", (self.host_id,))
            ).fetchone()
            if before is not None:
                await conn.execute("DELETE FROM placements WHERE host_id = %s AND expires_at <= now()", (self.host_id,))
                await conn.execute(sql, params)
            return before

        row = await self.store.run(work, what="heartbeating to")
        if row is None:
            raise StoreError(f"host {self.host_id!r} is not registered in the cluster catalog: register it again")
        self._note_return(row)
        return row[0] == "down"

    async def leave(self) -> None:
        """A graceful stop: 'stopping' (no new sessions are placed here; marked down if it does
        not come back within ``host_down_after``, or :data:`RESTART_GRACE_SECONDS` if longer)."""
        await self._execute(
            "UPDATE hosts SET status = 'stopping' WHERE host_id = %s", (self.host_id,), "leaving the cluster in"
        )

    def _note_return(self, previous: Sequence[Any] | None) -> None:
        if previous is not None and previous[0] == "down":
            log.warning(
                "this host had been marked down by the cluster: its sessions that were running are recorded lost",
                extra={"host": self.host_id},
            )

    # -- the cluster's hosts -------------------------------------------------------------------

    async def hosts(self, *, up_only: bool = True) -> list[HostInfo]:
        """Every host (by id), or only the 'up' ones."""
        where = "WHERE status = 'up' " if up_only else ""
        rows = await self._all(f"SELECT {_HOST_COLUMNS} FROM hosts {where}ORDER BY host_id", (), what="reading")
        return [HostInfo.from_row(row) for row in rows]

    async def place(self, runtime: str) -> HostInfo | None:
        """The 'up' host with most free room that has ``runtime`` (ties: fewer sessions, then
        host id), with one session counted on it at once and the placement recorded until the
        create reaches that host (:meth:`reserve` there); None when no host has room.

        Concurrent placements wait for each other's row lock (``SKIP LOCKED`` made a create
        that came during another's placement skip the only host with room and answer 503). A
        waiter whose host filled up meanwhile gets no row (PostgreSQL re-checks the outer
        conditions on the row it waited for, not the choice), so it asks again: the next host is
        then chosen. The choice takes no lock of its own: a ``FOR UPDATE`` there locked the row
        twice in one statement, and three placements at once deadlocked now and then (in 23 of 300
        bursts of 8 on two hosts, answered 503)."""
        sql = (
            "WITH chosen AS (UPDATE hosts SET free = free - 1, sessions = sessions + 1 WHERE host_id = ("
            "SELECT host_id FROM hosts WHERE status = 'up' AND %s = ANY(runtimes) AND free > 0 "
            "ORDER BY free DESC, sessions, host_id COLLATE \"C\" LIMIT 1) AND status = 'up' AND free > 0 "
            f"RETURNING {_HOST_COLUMNS}), "
            "placed AS (INSERT INTO placements (host_id, expires_at) "
            "SELECT host_id, now() + make_interval(secs => %s) FROM chosen) "
            f"SELECT {_HOST_COLUMNS} FROM chosen"
        )
        params = (runtime, float(self.placement_seconds))
        for _ in range(PLACE_ATTEMPTS):
            row = await self._row(sql, params, what="placing a session with")
            if row is not None:
                return HostInfo.from_row(row)
        return None

    async def mark_down_stale(self, after_seconds: float) -> list[str]:
        """Mark 'down' every other host whose heartbeat is more than ``after_seconds`` old, and in
        the same statement record its running sessions lost (reason: the host and its last
        heartbeat, UTC) and drop its reservations and placements. Returns the hosts marked down now."""
        sql = (
            "WITH down AS ("
            "  UPDATE hosts SET status = 'down' WHERE status <> 'down' AND host_id <> %(me)s"
            "  AND heartbeat_at < now() - make_interval(secs => CASE WHEN status = 'stopping'"
            "    THEN greatest(%(after)s, %(restart)s) ELSE %(after)s END)"
            "  RETURNING host_id, heartbeat_at"
            "), lost AS ("
            "  UPDATE sandboxes s SET state = %(lost)s, updated_at = extract(epoch FROM clock_timestamp()),"
            "  lost_reason = 'host ' || d.host_id || ' stopped answering at '"
            "    || to_char(d.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
            "  FROM down d WHERE s.host_id = d.host_id AND s.kind = %(session)s AND s.state = %(running)s"
            "  RETURNING s.session_id"
            "), dropped AS ("
            "  DELETE FROM reservations r USING down d WHERE r.host_id = d.host_id RETURNING r.session_id"
            "), unplaced AS ("
            "  DELETE FROM placements p USING down d WHERE p.host_id = d.host_id RETURNING p.id"
            ") SELECT host_id, (SELECT count(*) FROM lost) FROM down ORDER BY host_id"
        )
        params = {
            "me": self.host_id,
            "after": float(after_seconds),
            "restart": RESTART_GRACE_SECONDS,
            "lost": SandboxState.LOST.value,
            "session": SandboxKind.SESSION.value,
            "running": SandboxState.RUNNING.value,
        }
        rows = await self._all(sql, params, what="marking hosts down in")
        if rows:
            log.warning(
                "hosts stopped answering: marked down, their running sessions lost",
                extra={"hosts": [row[0] for row in rows], "lost": rows[0][1], "host": self.host_id},
            )
        return [row[0] for row in rows]

    # -- sessions across the cluster -----------------------------------------------------------

    async def owner(self, session_id: str) -> tuple[HostInfo, str] | None:
        """(the host that holds session ``session_id``, its tenant), whatever the host's status;
        None for an unknown session (or a pooled sandbox)."""
        sql = (
            f"SELECT {_H_HOST_COLUMNS}, s.tenant FROM sandboxes s JOIN hosts h ON h.host_id = s.host_id "
            "WHERE s.session_id = %s AND s.kind = %s AND s.tenant IS NOT NULL"
        )
        row = await self._row(sql, (session_id, SandboxKind.SESSION.value), what="reading")
        return (HostInfo.from_row(row), row[8]) if row is not None else None

    async def owner_of_kernel(self, kernel_id: str) -> tuple[HostInfo, str, str] | None:
        """(the host, the tenant, the session id) of the session whose kernel is ``kernel_id``."""
        sql = (
            f"SELECT {_H_HOST_COLUMNS}, s.tenant, s.session_id FROM sandboxes s JOIN hosts h ON h.host_id = s.host_id "
            "WHERE s.kernel_id = %s AND s.kind = %s AND s.tenant IS NOT NULL ORDER BY s.updated_at DESC LIMIT 1"
        )
        row = await self._row(sql, (kernel_id, SandboxKind.SESSION.value), what="reading")
        return (HostInfo.from_row(row), row[8], row[9]) if row is not None else None

    async def lost_on_down_host(self, session_id: str, tenant: str) -> SandboxRecord | None:
        """The tenant's session ``session_id`` if it was lost with a host that is down (no gateway
        can answer for it but the catalog), else None."""
        sql = (
            f"SELECT {_S_RECORD_COLUMNS} FROM sandboxes s JOIN hosts h ON h.host_id = s.host_id "
            "WHERE s.session_id = %s AND s.tenant = %s AND s.kind = %s AND s.state = %s AND h.status = 'down'"
        )
        params = (session_id, tenant, SandboxKind.SESSION.value, SandboxState.LOST.value)
        rows = await self._all(sql, params, what="reading")
        return self.store.records(rows)[0] if rows else None

    async def forget_lost(self, session_id: str, tenant: str) -> bool:
        """Delete the record of the tenant's session lost with a down host (its tenant deleted it:
        it no longer counts against the limit). True if there was one. The host, if it ever comes
        back, finds no record and reaps what is left of the sandbox."""
        sql = (
            "DELETE FROM sandboxes s USING hosts h WHERE h.host_id = s.host_id AND s.session_id = %s "
            "AND s.tenant = %s AND s.kind = %s AND s.state = %s AND h.status = 'down' RETURNING s.session_id"
        )
        params = (session_id, tenant, SandboxKind.SESSION.value, SandboxState.LOST.value)
        return bool(await self._all(sql, params, what="deleting a lost session in"))

    async def paused_on_down_host(
        self, session_id: str, tenant: str, snapshot_store: str
    ) -> tuple[SandboxRecord, str] | None:
        """(the record, its host) of the tenant's session ``session_id`` if it is paused on a host
        that is down and wrote its snapshots to the store ``snapshot_store`` (this host's: the
        snapshot is readable here); else None."""
        found = await self._paused_on_down(
            snapshot_store, "AND s.session_id = %s AND s.tenant = %s", (session_id, tenant)
        )
        return found[0] if found else None

    async def paused_on_down_hosts(self, snapshot_store: str, limit: int = 100) -> list[tuple[SandboxRecord, str]]:
        """(record, host) of sessions paused on hosts that are down and wrote to the snapshot store
        ``snapshot_store``, oldest first, at most ``limit`` (what no host expires while its host
        is away: :func:`~sandkernel.gateway.cluster.takeover.expire_paused_of_down_hosts`)."""
        return await self._paused_on_down(snapshot_store, "ORDER BY s.updated_at LIMIT %s", (int(limit),))

    async def _paused_on_down(
        self, snapshot_store: str, tail: str, params: tuple[Any, ...]
    ) -> list[tuple[SandboxRecord, str]]:
        """(record, host) of sessions paused on other hosts that are down with ``snapshot_store``,
        narrowed or ordered by ``tail`` (SQL after the shared conditions) and its ``params``."""
        sql = (
            f"SELECT {_S_RECORD_COLUMNS}, s.host_id FROM sandboxes s JOIN hosts h ON h.host_id = s.host_id "
            "WHERE s.kind = %s AND s.state = %s AND h.status = 'down' AND h.snapshot_store = %s AND h.host_id <> %s "
            + tail
        )
        shared = (SandboxKind.SESSION.value, SandboxState.PAUSED.value, snapshot_store, self.host_id)
        rows = await self._all(sql, (*shared, *params), what="reading")
        return [(self.store.records([row[:-1]])[0], row[-1]) for row in rows]

    async def take_over_paused(self, session_id: str, tenant: str, from_host: str) -> SandboxRecord | None:
        """Make this host the holder of the tenant's paused session, if it is still paused on
        ``from_host`` and that host is still down: one conditional statement, so of the gateways
        that try at once exactly one gets it (the record), the others None. A host that comes
        back later no longer finds it among its records."""
        sql = (
            "UPDATE sandboxes s SET host_id = %(me)s, updated_at = extract(epoch FROM clock_timestamp()) "
            "FROM hosts h WHERE h.host_id = s.host_id AND s.session_id = %(id)s AND s.tenant = %(tenant)s "
            "AND s.kind = %(session)s AND s.state = %(paused)s AND s.host_id = %(from)s AND h.status = 'down' "
            f"RETURNING {_S_RECORD_COLUMNS}"
        )
        params = {
            "me": self.host_id,
            "id": session_id,
            "tenant": tenant,
            "session": SandboxKind.SESSION.value,
            "paused": SandboxState.PAUSED.value,
            "from": from_host,
        }
        row = await self._row(sql, params, what="taking over a paused session in")
        return self.store.records([row])[0] if row is not None else None

    async def known_sessions(self, session_ids: list[str]) -> set[str]:
        """Which of ``session_ids`` any host records (whatever their state)."""
        rows = await self._all(
            "SELECT session_id FROM sandboxes WHERE session_id = ANY(%s)", (list(session_ids),), what="reading"
        )
        return {row[0] for row in rows}

    async def tenant_sessions(self, tenant: str) -> list[SandboxRecord]:
        """The tenant's sessions on every host (every state), oldest first."""
        sql = (
            f"SELECT {RECORD_COLUMNS} FROM sandboxes WHERE tenant = %s AND kind = %s "
            'ORDER BY created_at, session_id COLLATE "C"'
        )
        rows = await self._all(sql, (tenant, SandboxKind.SESSION.value), what="reading")
        return self.store.records(rows)

    async def reserve(self, tenant: str, limit: int | None, session_id: str) -> None:
        """Count session ``session_id`` against ``tenant``'s limit across the cluster, or raise
        :class:`TooManySessionsError` (429) if the tenant already has ``limit`` sessions (every
        state) and reservations. Atomic across hosts (the tenant's advisory lock); reserving the
        same session id again is a no-op. ``limit`` None: no limit, nothing recorded.

        This is where a create placed here arrives: one placement on this host (the oldest) is
        let go in the same transaction, as this host's own count includes the create from now on
        (placements are not told apart: any create that arrives stands for one on its way)."""
        if limit is None:
            await self._execute(_ARRIVED, (self.host_id,), "reserving a session in")
            return
        session = SandboxKind.SESSION.value

        async def work(conn: AsyncConnection) -> None:
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('sk-tenant:' || %s))", (tenant,))
            await conn.execute("DELETE FROM reservations WHERE tenant = %s AND expires_at < now()", (tenant,))
            held = await (
                await conn.execute(
                    "SELECT (SELECT count(*) FROM sandboxes WHERE tenant = %(t)s AND kind = %(k)s)"
                    " + (SELECT count(*) FROM reservations r WHERE r.tenant = %(t)s AND NOT EXISTS"
                    "    (SELECT 1 FROM sandboxes s WHERE s.session_id = r.session_id)),"
                    " EXISTS (SELECT 1 FROM reservations WHERE session_id = %(id)s)"
                    " OR EXISTS (SELECT 1 FROM sandboxes WHERE session_id = %(id)s)",
                    {"t": tenant, "k": session, "id": session_id},
                )
            ).fetchone()
            count, already = held
            if already:
                return
            if count >= limit:
                raise TooManySessionsError(
                    f"session limit reached ({limit} per token, across the cluster); delete a session first"
                )
            await conn.execute(
                "INSERT INTO reservations (session_id, tenant, host_id, expires_at) "
                "VALUES (%s, %s, %s, now() + make_interval(secs => %s))",
                (session_id, tenant, self.host_id, float(self.reservation_seconds)),
            )
            await conn.execute(_ARRIVED, (self.host_id,))

        await self.store.run(work, what="reserving a session in")

    async def release(self, session_id: str) -> None:
        """Give back a reservation whose session was never created (its create failed)."""
        await self._execute(
            "DELETE FROM reservations WHERE session_id = %s AND host_id = %s",
            (session_id, self.host_id),
            "releasing a reservation in",
        )

    # -- plumbing ------------------------------------------------------------------------------

    async def _execute(self, sql: str, params: Any, what: str) -> None:
        await self.store.run(lambda conn: conn.execute(sql, params), what=what)

    async def _row(self, sql: str, params: Any, *, what: str) -> tuple[Any, ...] | None:
        async def work(conn: AsyncConnection) -> tuple[Any, ...] | None:
            return await (await conn.execute(sql, params)).fetchone()

        return await self.store.run(work, what=what)

    async def _all(self, sql: str, params: Any, *, what: str) -> list[tuple[Any, ...]]:
        async def work(conn: AsyncConnection) -> list[tuple[Any, ...]]:
            return await (await conn.execute(sql, params)).fetchall()

        return await self.store.run(work, what=what)
