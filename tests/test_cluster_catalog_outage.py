"""An outage of the cluster's catalog itself marks no live host down (issue 18's failure
semantics: losing PostgreSQL fails creates fast while the sessions keep working).

Every host's last heartbeat is old when the catalog comes back after more than
``--host-down-after``; the first gateway through must not take that for the others being dead.
Real parts: PostgreSQL refusing every connection of the catalog's database for a while (as a
restarting or unreachable server does for its clients), the gateways' own membership loops.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse

import psycopg
import pytest

from sandkernel.gateway.cluster.catalog import ClusterCatalog
from sandkernel.gateway.cluster.membership import ClusterMembership
from sandkernel.gateway.cluster.postgres import PostgresStore
from sandkernel.kernels.model.records import SandboxRecord

pytestmark = pytest.mark.docker

INTERVAL = 0.2  # host-a's
SLOW_INTERVAL = 0.8  # host-b beats less often: after the outage, host-a gets through first
DOWN_AFTER = 2.0


def server_admin(database_url: str, sql: str) -> None:
    """Run SQL as the superuser from the server's maintenance database (not the catalog's)."""
    parts = urllib.parse.urlsplit(database_url)
    with psycopg.connect(parts._replace(path="/postgres").geturl(), autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)


def statuses(database_url: str) -> dict[str, str]:
    with psycopg.connect(database_url, connect_timeout=10) as conn:
        return dict(conn.execute("SELECT host_id, status FROM hosts").fetchall())


def beats(database_url: str) -> dict[str, object]:
    with psycopg.connect(database_url, connect_timeout=10) as conn:
        return dict(conn.execute("SELECT host_id, heartbeat_at FROM hosts").fetchall())


def session_state(database_url: str, session_id: str) -> str:
    with psycopg.connect(database_url, connect_timeout=10) as conn:
        return conn.execute("SELECT state FROM sandboxes WHERE session_id = %s", (session_id,)).fetchone()[0]


async def until(what: str, check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_a_catalog_outage_longer_than_host_down_after_marks_no_live_host_down(fresh_postgres_url):
    url = fresh_postgres_url
    database = urllib.parse.urlsplit(url).path.lstrip("/")
    stores = [await PostgresStore.open(url, host) for host in ("host-a", "host-b")]
    members = [
        ClusterMembership(
            ClusterCatalog(store, store.host_id), host_id=store.host_id, url=f"http://{store.host_id}",
            runtimes=["runc"], capacity=4, load=lambda: (1, 3), interval=interval, down_after=DOWN_AFTER,
        )
        for store, interval in zip(stores, (INTERVAL, SLOW_INTERVAL), strict=True)
    ]  # fmt: skip
    try:
        for member in members:
            await member.start()
        for store in stores:  # a live session on each: whichever gets through first must lose neither
            await store.put(SandboxRecord(f"{store.host_id}-live", "session", {"kernel_id": "k"}, tenant="alice"))

        # The catalog away for twice --host-down-after: every connection refused and cut.
        server_admin(url, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        server_admin(url, f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")
        await asyncio.sleep(2 * DOWN_AFTER)
        server_admin(url, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        back = beats(url)

        # Back: both beat again and judge nobody down for the outage.
        await until("both hosts beating again", lambda: all(beats(url)[h] > back[h] for h in back))
        await asyncio.sleep(DOWN_AFTER + 10 * INTERVAL)  # past the point where each judges the others
        assert statuses(url) == {"host-a": "up", "host-b": "up"}
        assert [session_state(url, f"{h}-live") for h in ("host-a", "host-b")] == ["running", "running"]

        # A host that really stops beating is still marked down, its live session lost.
        await members[1].stop()  # says 'stopping' (a restart): given the longer restart grace
        with psycopg.connect(url) as conn:  # crashed, not stopping: no goodbye
            conn.execute("UPDATE hosts SET status = 'up' WHERE host_id = 'host-b'")
        await until("host-b marked down", lambda: statuses(url)["host-b"] == "down")
        assert session_state(url, "host-b-live") == "lost"
    finally:
        server_admin(url, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        for member in members:
            await member.stop()
        for store in stores:
            await store.close()
