"""The session catalog on PostgreSQL: the one shared truth of a cluster of gateways.

:class:`PostgresStore` implements the same :class:`~.store.SessionStore` as the SQLite catalog,
with the same meaning for each call (put inserts or replaces; update changes only
:data:`~.records.UPDATABLE_FIELDS` and never re-creates a removed record; remove is quiet about
a missing record; load is oldest first; close is idempotent and later calls raise StoreError).
Several gateways share one database; each is one ``host_id`` and reads and writes only its own
rows of ``sandboxes``, so a gateway restarting on a host adopts exactly what that host ran. The
cluster's own tables (``hosts``, ``reservations``, ``placements``) are read and written by
``gateway/cluster/catalog.py`` through the same connection pool (:meth:`PostgresStore.run`).

Why each choice:

- **Nothing blocks the event loop.** psycopg 3's async connections in a psycopg_pool
  ``AsyncConnectionPool``: every call is a coroutine; the pool keeps a few connections open so a
  write is one round trip, not a login.
- **Records are stored as the SQLite catalog stores them.** The same columns (one per
  :class:`~.records.SandboxRecord` field) and the same encoding (``kernel``, ``gateway``,
  ``running`` as JSON text: byte-exact round trips, where ``jsonb`` would reorder keys and refuse
  ``\\u0000``), plus ``host_id`` (the owner) and ``kernel_id`` (``kernel["kernel_id"]``, indexed:
  any gateway can find the host of a kernel to forward a kernel-API request to it).
- **The password never leaves the URL.** Every error names the catalog as
  ``postgresql://user@host:port/db`` and has the password scrubbed out of whatever libpq said;
  errors are raised ``from None`` so a logged traceback carries no raw driver message either.
- **Fail fast when PostgreSQL is gone.** A connection attempt gives up after
  :data:`CONNECT_TIMEOUT` seconds (libpq ``connect_timeout``, TCP keepalives and
  ``tcp_user_timeout`` for a peer that vanished); the error is :class:`CatalogUnavailableError`
  (503: try again later), so creates fail at once while existing local sessions keep working.
  A pooled connection that broke since its last use (a PostgreSQL restart) is retried once on a
  fresh one (every statement here is safe to repeat); once PostgreSQL looks away, each call waits
  at most :data:`UNREACHABLE_WAIT` for a connection, until one call gets through again.
- **Upgrades migrate in one transaction, under a lock**: :mod:`.pg_schema` (the tables, their
  versions, the migration runner). A database a newer sandkernel migrated is refused.
- **One gateway per host id**: :mod:`.pg_host_lock`. :meth:`PostgresStore.open` takes a
  session-level advisory lock on the host id on a connection of its own, held until
  :meth:`PostgresStore.close`, and refuses to open (:class:`HostIdInUseError`, naming the holder)
  when another session holds it. Every connection's ``application_name`` names the gateway
  (``sandkernel <host id> <pid>@<machine>``) so the refusal can say which one. The lock dies with
  its connection: the membership heartbeat calls :meth:`PostgresStore.check_host_lock`, which
  notices and takes it again. If another gateway took it meanwhile, this store is *fenced*: it
  logs an error and refuses every further call (:class:`HostIdInUseError`, 503), so this gateway
  creates nothing, heartbeats nothing and writes no row the other now owns; its sessions still run
  locally. It stays fenced until it is restarted: the rows under this host id were the other's to
  adopt, and this gateway's view of them can no longer be trusted.

The names tests and the cluster catalog import from here (:data:`MIGRATIONS`,
:data:`SCHEMA_VERSION`, :func:`host_lock_key`, the errors) are re-exported from those modules.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sandkernel.gateway.cluster.pg_errors import (
    CatalogAddress,
    CatalogUnavailableError,
    HostIdInUseError,
    catalog_error,
)
from sandkernel.gateway.cluster.pg_host_lock import (
    HOST_LOCK_CLASS,
    acquire_host_lock,
    close_quietly,
    describe,
    holds_host_lock,
    host_lock_key,
    release_host_lock,
    take_host_lock,
)
from sandkernel.gateway.cluster.pg_schema import MIGRATIONS, SCHEMA_VERSION, migrate
from sandkernel.kernels.durable.store import _COLUMNS, StoreError, _row, records_from_rows, update_values
from sandkernel.kernels.model.records import SandboxRecord

try:  # the `cluster` extra: a single-host install imports this module without it
    import psycopg
    import psycopg.conninfo
    import psycopg_pool
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]
    psycopg_pool = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from psycopg import AsyncConnection

log = logging.getLogger(__name__)
T = TypeVar("T")

CONNECT_TIMEOUT = 5.0  # seconds: a login, or a wait for a pooled connection
# Seconds to wait for a connection once the catalog looked unreachable (the last call failed, or
# the pooled connection was broken): while PostgreSQL is away each call fails this fast.
UNREACHABLE_WAIT = 1.0
STATEMENT_TIMEOUT_MS = 15_000  # no statement (an advisory lock wait included) holds a caller longer
# A transaction of ours runs its statements back to back (no other I/O in between), so one that
# sits idle this long belongs to a gateway that froze (SIGSTOP, a hung VM, a cut network): the
# server ends it, and the row locks it held (a heartbeat locks its host's row) do not stop every
# other gateway from marking that host down.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 5_000
POOL_MAX = 8  # connections per gateway: its writes, the heartbeat, the catalog's look-ups
# The server drops a vanished lock holder's session (and so its lock) within about
# idle + interval * count seconds: a gateway cut off for good frees its host id in ~11 s.
_SERVER_KEEPALIVES = "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3"


_TABLE_COLUMNS = (*_COLUMNS, "host_id", "kernel_id")
_SELECT = ", ".join(_COLUMNS)


def application_name(host_id: str) -> str:
    """``sandkernel <host id> <pid>@<machine>`` in PostgreSQL's 63 bytes (the host id is cut
    first): what pg_stat_activity shows of this gateway, and what a refusal names."""
    tail = f" {os.getpid()}@{socket.gethostname()[:24]}"
    room = 63 - len(b"sandkernel ") - len(tail.encode())
    head = host_id.encode()[:room].decode(errors="ignore")
    return f"sandkernel {head}{tail}"


def kernel_id_of(kernel: Mapping[str, Any]) -> str | None:
    """The kernel id a record's ``kernel`` JSON names (``KernelSession.durable_state()`` writes
    ``kernel_id``; a paused session has none: no kernel runs)."""
    value = kernel.get("kernel_id")
    return value if isinstance(value, str) and value else None


class PostgresStore:
    """:class:`~.store.SessionStore` on PostgreSQL for one host; see the module docstring.

    Open it with :meth:`open` (never the constructor); :meth:`run` lends its pool to the cluster
    catalog (``gateway/cluster/catalog.py``)."""

    def __init__(
        self,
        address: CatalogAddress,
        host_id: str,
        pool: psycopg_pool.AsyncConnectionPool,
        lock: AsyncConnection,
    ) -> None:
        self.address = address
        self.host_id = host_id
        self._pool: psycopg_pool.AsyncConnectionPool | None = pool
        self._unreachable = False  # the last call could not reach PostgreSQL: wait only UNREACHABLE_WAIT
        self._lock: AsyncConnection | None = lock  # holds the host id's advisory lock (None: lost with it)
        self._lock_guard = asyncio.Lock()  # one check or re-take of the host lock at a time
        self._fenced: str | None = None  # another gateway took this host id: why every call is refused

    @classmethod
    async def open(
        cls,
        url: str,
        host_id: str,
        *,
        migrations: Mapping[int, Sequence[str]] | None = None,
        schema_version: int = SCHEMA_VERSION,
    ) -> PostgresStore:
        """Connect to the catalog at ``url`` as host ``host_id``: take the host id's lock (held
        until :meth:`close`), create or migrate the schema, open the connection pool.

        Raises :class:`HostIdInUseError` naming the holder when another gateway runs with this
        host id (nothing was done), :class:`CatalogUnavailableError` when PostgreSQL cannot be
        reached or refuses the login, :class:`StoreError` for a bad URL or host id, a database
        from a newer sandkernel, or a failed migration (nothing changed). ``migrations`` /
        ``schema_version`` replace the built-in ones (tests of the migration runner)."""
        if psycopg is None or psycopg_pool is None:
            raise StoreError("a PostgreSQL catalog needs psycopg 3 and psycopg-pool: pip install 'sandkernel[cluster]'")
        _check_host_id(host_id)
        address = CatalogAddress(url)
        kwargs = _connection_kwargs(host_id)
        try:
            psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.Error:
            raise StoreError(
                f"the catalog URL {address.display} is not a valid PostgreSQL URL (libpq cannot parse it)"
            ) from None
        lock = await acquire_host_lock(url, address, host_id, kwargs)
        try:
            await migrate(lock, address, MIGRATIONS if migrations is None else migrations, schema_version)
            pool = psycopg_pool.AsyncConnectionPool(
                url,
                min_size=1,
                max_size=POOL_MAX,
                kwargs=kwargs,
                open=False,
                timeout=CONNECT_TIMEOUT,
                name=f"sandkernel-catalog-{host_id}",
            )
            try:
                await pool.open(wait=True, timeout=CONNECT_TIMEOUT)
            except psycopg_pool.PoolTimeout:
                await pool.close()
                raise CatalogUnavailableError(
                    f"the session catalog {address.display} did not accept the connection pool within "
                    f"{CONNECT_TIMEOUT:g} s; check that PostgreSQL is up and its max_connections has room"
                ) from None
        except BaseException:
            await release_host_lock(lock, host_id)
            raise
        log.info("session catalog opened", extra={"catalog": address.display, "host": host_id})
        return cls(address, host_id, pool, lock)

    # -- the five calls ----------------------------------------------------------------------

    async def put(self, record: SandboxRecord) -> None:
        row = (*_row(record, updated_at=time.time()), self.host_id, kernel_id_of(record.kernel))
        columns = ", ".join(_TABLE_COLUMNS)
        changes = ", ".join(f"{name} = EXCLUDED.{name}" for name in _TABLE_COLUMNS if name != "session_id")
        sql = (
            f"INSERT INTO sandboxes ({columns}) VALUES ({', '.join(['%s'] * len(_TABLE_COLUMNS))}) "
            f"ON CONFLICT (session_id) DO UPDATE SET {changes} WHERE sandboxes.host_id = EXCLUDED.host_id "
            "RETURNING session_id"
        )

        async def work(conn: AsyncConnection) -> None:
            cursor = await conn.execute(sql, row)
            if await cursor.fetchone() is None:
                owner = await (
                    await conn.execute("SELECT host_id FROM sandboxes WHERE session_id = %s", (record.session_id,))
                ).fetchone()
                raise StoreError(
                    f"session {record.session_id!r} is recorded for host {owner[0] if owner else '?'!r}, not "
                    f"{self.host_id!r}: one host owns a session (nothing was changed)"
                )
            # The record is in: its reservation (gateway/cluster/catalog.py) has done its job.
            await conn.execute("DELETE FROM reservations WHERE session_id = %s", (record.session_id,))

        await self.run(work, what="writing")

    async def update(self, session_id: str, **fields: Any) -> None:
        values = update_values(fields)
        if not values:
            return
        if "kernel" in fields:
            values["kernel_id"] = kernel_id_of(fields["kernel"])
        assignments = ", ".join(f"{name} = %s" for name in values)
        sql = f"UPDATE sandboxes SET {assignments} WHERE session_id = %s AND host_id = %s"
        params = (*values.values(), session_id, self.host_id)
        await self.run(lambda conn: conn.execute(sql, params), what="writing")

    async def remove(self, session_id: str) -> None:
        async def work(conn: AsyncConnection) -> None:
            await conn.execute(
                "DELETE FROM sandboxes WHERE session_id = %s AND host_id = %s", (session_id, self.host_id)
            )
            await conn.execute(
                "DELETE FROM reservations WHERE session_id = %s AND host_id = %s", (session_id, self.host_id)
            )

        await self.run(work, what="writing")

    async def load(self) -> list[SandboxRecord]:
        sql = f'SELECT {_SELECT} FROM sandboxes WHERE host_id = %s ORDER BY created_at, session_id COLLATE "C"'

        async def work(conn: AsyncConnection) -> list[tuple[Any, ...]]:
            return await (await conn.execute(sql, (self.host_id,))).fetchall()

        return self.records(await self.run(work, what="reading"))

    async def close(self) -> None:
        """Close the pool and let go of the host id (unlocked before the connection closes, so a
        gateway started right after this one finds it free)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()
        async with self._lock_guard:
            lock, self._lock = self._lock, None
        if lock is not None:
            await release_host_lock(lock, self.host_id)

    # -- the host id's lock --------------------------------------------------------------------

    @property
    def fenced(self) -> str | None:
        """Why this store refuses every call (another gateway took its host id), or None."""
        return self._fenced

    async def check_host_lock(self) -> None:
        """Confirm this gateway still holds its host id; take it again if its connection broke.

        Called at each beat by the membership heartbeat (gateway/cluster/membership.py): one
        query on the lock's own connection. A lock lost with its connection (PostgreSQL
        restarted, the network was cut) is taken again on a new one. Raises
        :class:`CatalogUnavailableError` when PostgreSQL cannot be reached to take it again (the
        next check tries again), :class:`HostIdInUseError` when another gateway took it meanwhile:
        then the store is fenced (logged once as an error) and refuses every later call."""
        async with self._lock_guard:
            if self._pool is None:
                raise StoreError(f"the session catalog {self.address.display} is closed")
            if self._fenced is not None:
                raise HostIdInUseError(self._fenced)
            if self._lock is not None:
                if await holds_host_lock(self._lock, self.host_id):
                    return
                lost, self._lock = self._lock, None
                await close_quietly(lost)
                log.warning(
                    "the session catalog connection that held this host id broke, and the lock with it; "
                    "taking it again",
                    extra={"host": self.host_id},
                )
            lock, holder = await take_host_lock(
                self.address.url, self.address, self.host_id, _connection_kwargs(self.host_id)
            )
            if lock is not None:
                self._lock = lock
                log.warning("host id lock taken again", extra={"host": self.host_id})
                return
            if holder is None or holder.application_name == application_name(self.host_id):
                # Released as we looked, or still held by this process's own broken session,
                # which the server ends within seconds (its keepalives): try again next time.
                raise CatalogUnavailableError(
                    f"the lock on host id {self.host_id!r} in the session catalog {self.address.display} is still "
                    "held by this gateway's previous, broken connection; it is taken again at the next check"
                )
            self._fenced = (
                f"this gateway lost its hold on host id {self.host_id!r} in the session catalog "
                f"{self.address.display} (its connection broke) and another gateway took it ({describe(holder)}): "
                "two gateways run with one host id. This one now refuses every catalog call (no creates, no "
                "heartbeats, no records) so it cannot overwrite what the other owns; its sessions keep running "
                "here. Stop one of the two gateways, or give one another --host-id, then restart this one"
            )
            log.error("%s", self._fenced, extra={"host": self.host_id, "holder": holder.application_name})
            raise HostIdInUseError(self._fenced)

    # -- shared with the cluster catalog -----------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._pool is None

    def records(self, rows: Sequence[Sequence[Any]]) -> list[SandboxRecord]:
        """Rows of ``SELECT <the record's columns>`` as records; StoreError naming a bad row."""
        return records_from_rows(rows, self.address.display, "fix or delete that row")

    async def run(self, work: Callable[[AsyncConnection], Awaitable[T]], *, what: str = "using") -> T:
        """Run ``work`` on a pooled connection in one transaction (committed when it returns,
        rolled back when it raises); driver errors become StoreError without the password.

        ``work`` may run twice: when the pooled connection turns out to be broken (PostgreSQL
        restarted since its last use) it is run again on a fresh one, so it must be safe to
        repeat. Errors of our own raised by ``work`` (StoreError, a limit) pass through."""
        for attempt in (1, 2):
            pool = self._pool
            if pool is None:
                raise StoreError(f"the session catalog {self.address.display} is closed")
            if self._fenced is not None:
                raise HostIdInUseError(self._fenced)
            wait = UNREACHABLE_WAIT if self._unreachable or attempt == 2 else CONNECT_TIMEOUT
            used: AsyncConnection | None = None
            try:
                async with pool.connection(timeout=wait) as conn:
                    used = conn
                    result = await work(conn)
                self._unreachable = False
                return result
            except psycopg_pool.PoolTimeout:
                self._unreachable = True
                raise CatalogUnavailableError(
                    f"{what} the session catalog {self.address.display} failed: no connection to PostgreSQL "
                    f"within {wait:g} s; check that it is up and reachable from host {self.host_id!r}"
                ) from None
            except psycopg_pool.PoolClosed:
                raise StoreError(f"the session catalog {self.address.display} is closed") from None
            except psycopg.Error as err:
                if isinstance(err, psycopg.OperationalError) and used is not None and used.closed:
                    if attempt == 1:
                        log.info("catalog connection was broken; retrying once", extra={"host": self.host_id})
                        continue
                    self._unreachable = True
                raise catalog_error(
                    self.address, err, f"{what} the session catalog {self.address.display} failed"
                ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def __repr__(self) -> str:
        return f"PostgresStore({self.address.display!r}, host_id={self.host_id!r})"


def _check_host_id(host_id: str) -> None:
    if not isinstance(host_id, str) or not host_id or len(host_id) > 200 or not host_id.isprintable():
        raise StoreError(f"a host id is 1 to 200 printable characters, not {host_id!r}")


def _connection_kwargs(host_id: str) -> dict[str, Any]:
    """libpq settings of every catalog connection: give up on a dead peer in seconds, and name
    the gateway in pg_stat_activity."""
    return {
        "connect_timeout": max(1, round(CONNECT_TIMEOUT)),
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": int(CONNECT_TIMEOUT * 2000),
        "application_name": application_name(host_id),
        "options": (
            f"-c statement_timeout={STATEMENT_TIMEOUT_MS} "
            f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_MS} {_SERVER_KEEPALIVES}"
        ),
    }


# The record's own columns, in SandboxRecord's field order: what :meth:`PostgresStore.records` reads.
RECORD_COLUMNS = _SELECT

__all__ = [
    "CONNECT_TIMEOUT",
    "HOST_LOCK_CLASS",
    "MIGRATIONS",
    "RECORD_COLUMNS",
    "SCHEMA_VERSION",
    "CatalogAddress",
    "CatalogUnavailableError",
    "HostIdInUseError",
    "PostgresStore",
    "application_name",
    "host_lock_key",
    "kernel_id_of",
]
