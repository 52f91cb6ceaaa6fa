"""One gateway per host id on the PostgreSQL session catalog: the host id's advisory lock.

Two gateways with the same ``host_id`` (two machines with the same host name, a copy-pasted
``--host-id``) would both claim, adopt and reap the same rows. The SQLite catalog is guarded by a
file lock on the state dir; here :meth:`~.postgres.PostgresStore.open` takes a session-level
advisory lock on the host id (:data:`HOST_LOCK_CLASS`, :func:`host_lock_key`) on a connection of
its own (:func:`acquire_host_lock`), held until the store closes (:func:`release_host_lock`), and
refuses to open (:class:`~.pg_errors.HostIdInUseError`, naming the holder from
``pg_stat_activity``: :class:`LockHolder`) when another session holds it. The lock dies with its
connection (a PostgreSQL restart, a cut network, a DBA's ``pg_terminate_backend``): the store's
``check_host_lock`` asks :func:`holds_host_lock` at each heartbeat and takes it again
(:func:`take_host_lock`), or fences the store when another gateway took it meanwhile.

The connection is the caller's to configure (``kwargs``: libpq settings, the application_name a
refusal names); this module only takes, checks and lets go of the lock on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandkernel.gateway.cluster.pg_errors import CatalogAddress, HostIdInUseError, catalog_error, unreachable

try:  # the `cluster` extra; PostgresStore.open refuses before anything here runs without it
    import psycopg
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from psycopg import AsyncConnection

# The first key of the two-key advisory lock a gateway holds on its host id ("skhi"): the
# two-key form has a key space of its own, apart from the one-key schema and tenant locks.
HOST_LOCK_CLASS = 0x736B6869
# Seconds the host lock's check may take before its connection counts as broken (under the
# heartbeat's BEAT_TIMEOUT_SECONDS, so a hung check never costs a beat by itself).
LOCK_CHECK_TIMEOUT = 3.0
# Seconds an open waits for a host id's lock before refusing: the session of a gateway with this
# host id that just stopped or died ends a moment after its socket closes.
HOST_LOCK_WAIT = 3.0


def host_lock_key(host_id: str) -> tuple[int, int]:
    """The two int4 keys of ``pg_try_advisory_lock(int, int)`` for ``host_id``: the class of
    sandkernel host locks, and 31 bits of the host id's SHA-256 (non-negative, so the key reads
    the same in ``pg_locks.objid``, an oid)."""
    digest = hashlib.sha256(host_id.encode("utf-8", "surrogatepass")).digest()
    return HOST_LOCK_CLASS, int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@dataclass(frozen=True)
class LockHolder:
    """The server session holding a host id's lock, as pg_stat_activity shows it (what a
    refusal names; fields another role's session hides are None)."""

    backend_pid: int
    application_name: str | None
    client_addr: str | None
    client_port: int | None


def describe(holder: LockHolder | None) -> str:
    """``held by '<application_name>' connected from <where>, …``: the holder, for a refusal."""
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


async def acquire_host_lock(
    url: str, address: CatalogAddress, host_id: str, kwargs: Mapping[str, Any]
) -> AsyncConnection:
    """A new connection holding ``host_id``'s lock, for an open. A holder that is going away (a
    gateway of this host id that just stopped or died: its server session ends a moment after its
    socket closes) is waited for, up to :data:`HOST_LOCK_WAIT` seconds; then
    :class:`HostIdInUseError` naming the holder (nothing was done). CatalogUnavailableError when
    PostgreSQL cannot be reached, StoreError for another refusal."""
    deadline = time.monotonic() + HOST_LOCK_WAIT
    while True:
        lock, holder = await take_host_lock(url, address, host_id, kwargs)
        if lock is not None:
            return lock
        if time.monotonic() >= deadline:
            raise HostIdInUseError(
                f"another gateway runs with host id {host_id!r} on the session catalog {address.display} "
                f"({describe(holder)}): two gateways with one host id would claim, adopt and reap each other's "
                "sessions, so this one did not start and changed nothing. Stop the other gateway, or give this "
                "one another --host-id"
            )
        await asyncio.sleep(0.2)


async def take_host_lock(
    url: str, address: CatalogAddress, host_id: str, kwargs: Mapping[str, Any]
) -> tuple[AsyncConnection | None, LockHolder | None]:
    """A new connection holding ``host_id``'s lock, (conn, None); or (None, the holder) when
    another session holds it (None when it ended as we looked). CatalogUnavailableError when
    PostgreSQL cannot be reached, StoreError for another refusal."""
    try:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True, **kwargs)
    except psycopg.Error as err:
        raise unreachable(address, err) from None
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
        except psycopg.Error as err:
            failed = f"taking the lock on host id {host_id!r} in the session catalog {address.display} failed"
            raise catalog_error(address, err, failed, opening=True) from None
    except BaseException:
        await close_quietly(conn)
        raise
    await close_quietly(conn)
    return None, (LockHolder(*found) if found is not None else None)


async def holds_host_lock(conn: AsyncConnection, host_id: str) -> bool:
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


async def release_host_lock(conn: AsyncConnection, host_id: str) -> None:
    """Unlock (quietly: a broken connection holds nothing) and close the lock's connection."""
    with contextlib.suppress(psycopg.Error, asyncio.TimeoutError):
        await asyncio.wait_for(
            conn.execute("SELECT pg_advisory_unlock(%s::int4, %s::int4)", host_lock_key(host_id)), LOCK_CHECK_TIMEOUT
        )
    await close_quietly(conn)


async def close_quietly(conn: AsyncConnection) -> None:
    """Close a lock connection, bounded by LOCK_CHECK_TIMEOUT; a broken one closes without a word."""
    with contextlib.suppress(psycopg.Error, asyncio.TimeoutError, OSError):
        await asyncio.wait_for(conn.close(), LOCK_CHECK_TIMEOUT)
