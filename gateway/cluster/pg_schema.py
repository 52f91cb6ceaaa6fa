"""The schema of the PostgreSQL session catalog, and how a gateway brings a database to it.

**Upgrades migrate in one transaction, under a lock.** ``sandkernel_meta`` holds the schema
version and the sandkernel versions that created and last migrated it; the missing steps of
:data:`MIGRATIONS` run in one transaction holding an advisory lock (:data:`SCHEMA_LOCK`), so
gateways starting together migrate once, and a failing step changes nothing. A database a newer
sandkernel migrated is refused (nothing changed): an older gateway must not write rows it cannot
read. :meth:`~.postgres.PostgresStore.open` calls :func:`migrate` on its host-lock connection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from sandkernel import __version__
from sandkernel.gateway.cluster.pg_errors import CatalogAddress, catalog_error
from sandkernel.kernels.durable.store import StoreError

try:  # the `cluster` extra; PostgresStore.open refuses before anything here runs without it
    import psycopg
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from psycopg import AsyncConnection

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
SCHEMA_LOCK = "sk-schema"  # pg_advisory_xact_lock(hashtext(...)) while migrating

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


async def migrate(
    conn: AsyncConnection, address: CatalogAddress, migrations: Mapping[int, Sequence[str]], target: int
) -> None:
    """Bring the schema to ``target`` in one transaction holding the schema lock; refuse a
    database that is newer, or that has our tables without our version table."""
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (SCHEMA_LOCK,))
            version, writer = await schema_version(conn, address)
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
    except psycopg.Error as err:
        failed = f"migrating the session catalog {address.display} failed and was rolled back, nothing was changed"
        raise catalog_error(address, err, failed, opening=True) from None


async def schema_version(conn: AsyncConnection, address: CatalogAddress) -> tuple[int, str]:
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
