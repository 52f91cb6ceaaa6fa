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
- **Upgrades migrate in one transaction, under a lock.** ``sandkernel_meta`` holds the schema
  version and the sandkernel versions that created and last migrated it; the missing steps of
  :data:`MIGRATIONS` run in one transaction holding an advisory lock, so gateways starting
  together migrate once, and a failing step changes nothing. A database a newer sandkernel
  migrated is refused (nothing changed): an older gateway must not write rows it cannot read.
- **One gateway per host id.** Two gateways with the same ``host_id`` (two machines with the same
  host name, a copy-pasted ``--host-id``) would both claim, adopt and reap the same rows. The
  SQLite catalog is guarded by a file lock on the state dir; here :meth:`PostgresStore.open`
  takes a session-level advisory lock on the host id (:data:`HOST_LOCK_CLASS`, :func:`host_lock_key`)
  on a connection of its own, held until :meth:`PostgresStore.close`, and refuses to open
  (:class:`HostIdInUseError`, naming the holder from ``pg_stat_activity``) when another session
  holds it. Every connection's ``application_name`` names the gateway (``sandkernel <host id>
  <pid>@<machine>``) so the refusal can say which one. The lock dies with its connection (a
  PostgreSQL restart, a cut network, a DBA's ``pg_terminate_backend``): the membership heartbeat
  calls :meth:`PostgresStore.check_host_lock`, which notices and takes it again. If another
  gateway took it meanwhile, this store is *fenced*: it logs an error and refuses every further
  call (:class:`HostIdInUseError`, 503), so this gateway creates nothing, heartbeats nothing and
  writes no row the other now owns; its sessions still run locally. It stays fenced until it is
  restarted: the rows under this host id were the other's to adopt, and this gateway's view of
  them can no longer be trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sandkernel import __version__
from sandkernel.kernels.durable.records import SandboxRecord
from sandkernel.kernels.durable.store import _COLUMNS, StoreError, _row, records_from_rows, update_values

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

SCHEMA_VERSION = 3
CONNECT_TIMEOUT = 5.0  # seconds: a login, or a wait for a pooled connection
# Seconds to wait for a connection once the catalog looked unreachable (the last call failed, or
# the pooled connection was broken): while PostgreSQL is away each call fails this fast.
UNREACHABLE_WAIT = 1.0
STATEMENT_TIMEOUT_MS = 15_000  # no statement (an advisory lock wait included) holds a caller longer
POOL_MAX = 8  # connections per gateway: its writes, the heartbeat, the catalog's look-ups
SCHEMA_LOCK = "sk-schema"  # pg_advisory_xact_lock(hashtext(...)) while migrating
# The first key of the two-key advisory lock a gateway holds on its host id ("skhi"): the
# two-key form has a key space of its own, apart from the one-key schema and tenant locks.
HOST_LOCK_CLASS = 0x736B6869
# Seconds the host lock's check may take before its connection counts as broken (under the
# heartbeat's BEAT_TIMEOUT_SECONDS, so a hung check never costs a beat by itself).
LOCK_CHECK_TIMEOUT = 3.0
# Seconds an open waits for a host id's lock before refusing: the session of a gateway with this
# host id that just stopped or died ends a moment after its socket closes.
HOST_LOCK_WAIT = 3.0
# The server drops a vanished lock holder's session (and so its lock) within about
# idle + interval * count seconds: a gateway cut off for good frees its host id in ~11 s.
_SERVER_KEEPALIVES = "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3"

# Each version's SQL statements, run in order inside the open's transaction. Version 1 creates the
# tables; ``sandboxes`` has one column per SandboxRecord field (as the SQLite catalog) + host_id,
# kernel_id. Times of records are epoch seconds (the records' own); hosts' times are the server's.
MIGRATIONS: dict[int, Sequence[str]] = {
    1: (
        "CREATE TABLE sandkernel_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE sandboxes (
            session_id  TEXT PRIMARY KEY,
            host_id     TEXT NOT NULL,
            kernel_id   TEXT,
            kind        TEXT NOT NULL,
            state       TEXT NOT NULL,
            tenant      TEXT,
            kernel      TEXT NOT NULL,
            gateway     TEXT NOT NULL,
            running     TEXT,
            lost_reason TEXT,
            created_at  DOUBLE PRECISION NOT NULL,
            updated_at  DOUBLE PRECISION NOT NULL
        )""",
        "CREATE INDEX sandboxes_host ON sandboxes (host_id, created_at)",
        "CREATE INDEX sandboxes_tenant ON sandboxes (tenant, created_at)",
        "CREATE INDEX sandboxes_kernel ON sandboxes (kernel_id)",
        """CREATE TABLE hosts (
            host_id      TEXT PRIMARY KEY,
            url          TEXT NOT NULL,
            runtimes     TEXT[] NOT NULL,
            capacity     INTEGER NOT NULL,
            sessions     INTEGER NOT NULL DEFAULT 0,
            free         INTEGER NOT NULL DEFAULT 0,
            status       TEXT NOT NULL CHECK (status IN ('up', 'down', 'stopping')),
            started_at   TIMESTAMPTZ NOT NULL,
            heartbeat_at TIMESTAMPTZ NOT NULL,
            version      TEXT NOT NULL
        )""",
        # A session counted against its tenant's limit between reserve and the record's put.
        """CREATE TABLE reservations (
            session_id TEXT PRIMARY KEY,
            tenant     TEXT NOT NULL,
            host_id    TEXT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL
        )""",
        "CREATE INDEX reservations_tenant ON reservations (tenant)",
    ),
    # A session placed on a host whose create has not reached that host yet (the forwarded request
    # is on its way): the host's heartbeat cannot count it, so the catalog subtracts it from the
    # room the heartbeat reports, until the create arrives (ClusterCatalog.reserve) or it expires.
    2: (
        """CREATE TABLE placements (
            id         BIGSERIAL PRIMARY KEY,
            host_id    TEXT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL
        )""",
        "CREATE INDEX placements_host ON placements (host_id, id)",
    ),
    # Which snapshot store each host writes to (SnapshotStore.store_id; NULL: none said): hosts
    # with the same one share a snapshot dir, so a host resumes what a down host paused.
    3: ("ALTER TABLE hosts ADD COLUMN snapshot_store TEXT",),
}

_TABLE_COLUMNS = (*_COLUMNS, "host_id", "kernel_id")
_SELECT = ", ".join(_COLUMNS)


class CatalogUnavailableError(StoreError):
    """PostgreSQL cannot be reached (down, unreachable, refusing this gateway's login): the
    request that needed the catalog fails now; try again later."""

    status = 503


class HostIdInUseError(StoreError):
    """Another gateway holds this host id in the shared catalog: two gateways on one host id would
    claim, adopt and reap the same sessions. At start-up nothing was done; later (the lock was lost
    and another gateway took it) this store refuses every call until the gateway is restarted."""

    status = 503
    code = "host_id_in_use"


def host_lock_key(host_id: str) -> tuple[int, int]:
    """The two int4 keys of ``pg_try_advisory_lock(int, int)`` for ``host_id``: the class of
    sandkernel host locks, and 31 bits of the host id's SHA-256 (non-negative, so the key reads
    the same in ``pg_locks.objid``, an oid)."""
    digest = hashlib.sha256(host_id.encode("utf-8", "surrogatepass")).digest()
    return HOST_LOCK_CLASS, int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


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


class CatalogAddress:
    """A ``postgresql://`` URL, and how to name it in an error without its password."""

    def __init__(self, url: str) -> None:
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("postgresql", "postgres"):
            raise StoreError("the catalog URL must be a postgresql://user:password@host:port/database URL")
        self.url = url
        self._secrets = _password_forms(url)
        parts = urllib.parse.urlsplit(url)
        try:
            host, port = parts.hostname or "localhost", parts.port or 5432
        except ValueError:
            raise StoreError(f"the catalog URL {self.scrub(url)!r} has an invalid port") from None
        user = f"{urllib.parse.unquote(parts.username)}@" if parts.username else ""
        self.display = f"postgresql://{user}{host}:{port}{parts.path or '/'}"

    def scrub(self, text: str) -> str:
        """``text`` with every form of the password replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def __repr__(self) -> str:
        return f"CatalogAddress({self.display!r})"


def _password_forms(url: str) -> list[str]:
    """The password of ``url`` (in the user part or as ``?password=``) as written, decoded and
    encoded: every form an error message could quote."""
    parts = urllib.parse.urlsplit(url)
    found: list[str] = []
    with_user = parts.netloc.rpartition("@")[0]
    if ":" in with_user:
        found.append(with_user.partition(":")[2])
    for pair in parts.query.split("&"):
        key, _, value = pair.partition("=")
        if urllib.parse.unquote_plus(key) == "password":
            found.append(value)
    forms = {
        form
        for raw in found
        for form in (raw, urllib.parse.unquote(raw), urllib.parse.unquote_plus(raw), urllib.parse.quote(raw, safe=""))
        if form
    }
    return sorted(forms, key=len, reverse=True)  # longest first: a form inside another is replaced after it


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
        # A holder that is going away (a gateway of this host id that just stopped or died: its
        # server session ends a moment after its socket closes) is waited for, briefly.
        deadline = time.monotonic() + HOST_LOCK_WAIT
        while True:
            lock, holder = await _take_host_lock(url, address, host_id, kwargs)
            if lock is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        if lock is None:
            raise HostIdInUseError(
                f"another gateway runs with host id {host_id!r} on the session catalog {address.display} "
                f"({_describe(holder)}): two gateways with one host id would claim, adopt and reap each other's "
                "sessions, so this one did not start and changed nothing. Stop the other gateway, or give this "
                "one another --host-id"
            )
        try:
            await _migrate(lock, address, MIGRATIONS if migrations is None else migrations, schema_version)
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
            await _release_host_lock(lock, host_id)
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
            await _release_host_lock(lock, self.host_id)

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
                if await _holds_host_lock(self._lock, self.host_id):
                    return
                lost, self._lock = self._lock, None
                await _close_quietly(lost)
                log.warning(
                    "the session catalog connection that held this host id broke, and the lock with it; "
                    "taking it again",
                    extra={"host": self.host_id},
                )
            lock, holder = await _take_host_lock(
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
                f"{self.address.display} (its connection broke) and another gateway took it ({_describe(holder)}): "
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
            except psycopg.OperationalError as err:
                if used is not None and used.closed:
                    if attempt == 1:
                        log.info("catalog connection was broken; retrying once", extra={"host": self.host_id})
                        continue
                    self._unreachable = True
                raise CatalogUnavailableError(
                    f"{what} the session catalog {self.address.display} failed: {self.address.scrub(str(err))}"
                ) from None
            except psycopg.Error as err:
                raise StoreError(
                    f"{what} the session catalog {self.address.display} failed: {self.address.scrub(str(err))}"
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
        "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS} {_SERVER_KEEPALIVES}",
    }


@dataclass(frozen=True)
class LockHolder:
    """The server session holding a host id's lock, as pg_stat_activity shows it (what a
    refusal names; fields another role's session hides are None)."""

    backend_pid: int
    application_name: str | None
    client_addr: str | None
    client_port: int | None


def _describe(holder: LockHolder | None) -> str:
    if holder is None:
        return "its holder ended as this one looked"
    if holder.client_addr:
        where = f"{holder.client_addr}:{holder.client_port}"
    elif holder.client_port == -1:  # pg_stat_activity's mark of a unix socket
        where = "a local socket"
    else:
        where = "an address this database user may not see"
    name = repr(holder.application_name) if holder.application_name else "a session with no application_name"
    return f"held by {name} connected from {where}, PostgreSQL backend pid {holder.backend_pid}"


async def _take_host_lock(
    url: str, address: CatalogAddress, host_id: str, kwargs: Mapping[str, Any]
) -> tuple[AsyncConnection | None, LockHolder | None]:
    """A new connection holding ``host_id``'s lock, (conn, None); or (None, the holder) when
    another session holds it (None when it ended as we looked). CatalogUnavailableError when
    PostgreSQL cannot be reached, StoreError for another refusal."""
    try:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True, **kwargs)
    except psycopg.Error as err:
        raise _unreachable(address, err) from None
    key = host_lock_key(host_id)
    try:
        try:
            row = await (await conn.execute("SELECT pg_try_advisory_lock(%s::int4, %s::int4)", key)).fetchone()
            if row is not None and row[0]:
                return conn, None
            found = await (
                await conn.execute(
                    "SELECT l.pid, a.application_name, host(a.client_addr), a.client_port FROM pg_locks l "
                    "LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
                    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                    "AND l.classid = %s::int4::oid AND l.objid = %s::int4::oid AND l.objsubid = 2",
                    key,
                )
            ).fetchone()
        except psycopg.OperationalError as err:
            raise _unreachable(address, err) from None
        except psycopg.Error as err:
            raise StoreError(
                f"taking the lock on host id {host_id!r} in the session catalog {address.display} failed: "
                f"{address.scrub(str(err))}"
            ) from None
    except BaseException:
        await _close_quietly(conn)
        raise
    await _close_quietly(conn)
    return None, (LockHolder(*found) if found is not None else None)


async def _holds_host_lock(conn: AsyncConnection, host_id: str) -> bool:
    """This connection is alive and its session holds ``host_id``'s lock (within LOCK_CHECK_TIMEOUT)."""
    sql = (
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND granted "
        "AND classid = %s::int4::oid AND objid = %s::int4::oid AND objsubid = 2)"
    )

    async def ask() -> bool:
        row = await (await conn.execute(sql, host_lock_key(host_id))).fetchone()
        return bool(row and row[0])

    try:
        return await asyncio.wait_for(ask(), LOCK_CHECK_TIMEOUT)
    except (psycopg.Error, asyncio.TimeoutError):
        return False


async def _release_host_lock(conn: AsyncConnection, host_id: str) -> None:
    """Unlock (quietly: a broken connection holds nothing) and close the lock's connection."""
    with contextlib.suppress(psycopg.Error, asyncio.TimeoutError):
        await asyncio.wait_for(
            conn.execute("SELECT pg_advisory_unlock(%s::int4, %s::int4)", host_lock_key(host_id)), LOCK_CHECK_TIMEOUT
        )
    await _close_quietly(conn)


async def _close_quietly(conn: AsyncConnection) -> None:
    with contextlib.suppress(psycopg.Error, asyncio.TimeoutError, OSError):
        await asyncio.wait_for(conn.close(), LOCK_CHECK_TIMEOUT)


def _unreachable(address: CatalogAddress, err: Exception) -> CatalogUnavailableError:
    why = address.scrub(str(err)).strip() or type(err).__name__
    return CatalogUnavailableError(
        f"cannot open the session catalog {address.display}: {why}. Check --catalog-url (host, port, database, "
        "user and password), that PostgreSQL is running and reachable from this host, and that its pg_hba.conf "
        "lets this user in"
    )


async def _migrate(
    conn: AsyncConnection, address: CatalogAddress, migrations: Mapping[int, Sequence[str]], target: int
) -> None:
    """Bring the schema to ``target`` in one transaction holding the schema lock; refuse a
    database that is newer, or that has our tables without our version table."""
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (SCHEMA_LOCK,))
            version, writer = await _schema_version(conn, address)
            if version > target:
                raise StoreError(
                    f"the session catalog {address.display} has schema version {version}, written by sandkernel "
                    f"{writer}; this is sandkernel {__version__}, which knows versions up to {target}. Nothing was "
                    "changed: run the newer sandkernel on this host (or a catalog of its own)"
                )
            if version == target:
                return
            for step in range(version + 1, target + 1):
                if step not in migrations:
                    raise StoreError(f"no migration to version {step} of the session catalog {address.display}")
                for statement in migrations[step]:
                    await conn.execute(statement)
            meta = {"schema_version": str(target), "migrated_by": __version__}
            if version == 0:
                meta["created_by"] = __version__
            for key, value in meta.items():
                await conn.execute(
                    "INSERT INTO sandkernel_meta (key, value) VALUES (%s, %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                    (key, value),
                )
        log.info("session catalog schema migrated", extra={"catalog": address.display, "from": version, "to": target})
    except StoreError:
        raise
    except psycopg.OperationalError as err:
        raise _unreachable(address, err) from None
    except psycopg.Error as err:
        raise StoreError(
            f"migrating the session catalog {address.display} failed and was rolled back, nothing was changed: "
            f"{address.scrub(str(err))}"
        ) from None


async def _schema_version(conn: AsyncConnection, address: CatalogAddress) -> tuple[int, str]:
    """(schema version, the sandkernel that last migrated it); (0, "") for a database without our tables."""
    names = {
        row[0]
        for row in await (
            await conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() "
                "AND table_name = ANY(%s)",
                (["sandkernel_meta", "sandboxes", "hosts", "reservations", "placements"],),
            )
        ).fetchall()
    }
    if "sandkernel_meta" not in names:
        if names:
            raise StoreError(
                f"the database of {address.display} has tables {sorted(names)} but no sandkernel_meta table: it "
                "is not a sandkernel catalog, and nothing was changed. Give the cluster a database of its own"
            )
        return 0, ""
    meta = dict(await (await conn.execute("SELECT key, value FROM sandkernel_meta")).fetchall())
    try:
        return int(meta["schema_version"]), meta.get("migrated_by", "(unknown version)")
    except (KeyError, ValueError):
        raise StoreError(
            f"the session catalog {address.display} has no valid schema_version in sandkernel_meta; nothing was changed"
        ) from None


# The record's own columns, in SandboxRecord's field order: what :meth:`PostgresStore.records` reads.
RECORD_COLUMNS = _SELECT
