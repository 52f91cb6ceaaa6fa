"""The cluster's catalog on a real PostgreSQL 15 (tests/postgres_fixtures.py: a throwaway server on
127.0.0.1, a fresh database per test), no mocks: PostgresStore keeps the SQLite catalog's meaning
for each call and scopes every host to its own rows; ClusterCatalog places sessions, holds tenants'
limits across hosts under concurrency, and turns a silent host's running sessions into lost ones.
The SessionStore calls both catalogs share are tested over both in tests/test_session_store.py."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import socket
import time
import traceback

import psycopg
import pytest

from sandkernel.errors import SandboxLostError
from sandkernel.gateway.cluster import pg_host_lock
from sandkernel.gateway.cluster.catalog import ClusterCatalog, HostInfo
from sandkernel.gateway.cluster.membership import ClusterMembership
from sandkernel.gateway.cluster.postgres import (
    CONNECT_TIMEOUT,
    MIGRATIONS,
    SCHEMA_VERSION,
    CatalogUnavailableError,
    HostIdInUseError,
    PostgresStore,
    application_name,
    host_lock_key,
)
from sandkernel.gateway.managed import TooManySessionsError
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.durable.store import StoreError
from sandkernel.kernels.model.records import SandboxRecord, SandboxState

from . import postgres_fixtures
from .conftest import container_ids_of
from .postgres_fixtures import PostgresServer, running_postgres
from .test_cluster_membership import clean_up_hosts, cluster_flags, rows
from .test_durable_sessions import Serve

pytestmark = pytest.mark.docker

# The fixtures, bound here so pytest finds them (an import would read as unused to the linter).
postgres_server = postgres_fixtures.postgres_server
fresh_postgres_url = postgres_fixtures.fresh_postgres_url


def record(session_id: str, **fields) -> SandboxRecord:
    kernel = fields.pop(
        "kernel",
        {"kernel_id": f"k-{session_id}", "container_id": "c" * 64, "connection": {"key": f"hmac-{session_id}"}},
    )
    return SandboxRecord(session_id=session_id, kind=fields.pop("kind", "session"), kernel=kernel, **fields)


def admin(url: str, sql: str, params=()) -> list[tuple]:
    """Run SQL as the server's superuser outside the code under test (a test's view of the tables)."""
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the SessionStore on PostgreSQL: what only it does (the calls both catalogs answer alike are
# -- tested over both in tests/test_session_store.py) -------------------------------------------


async def test_a_host_reads_and_writes_only_its_own_rows(fresh_postgres_url):
    a = await PostgresStore.open(fresh_postgres_url, "host-a")
    b = await PostgresStore.open(fresh_postgres_url, "host-b")
    try:
        await a.put(record("s1", tenant="alice"))
        await b.put(record("s2", tenant="alice"))
        assert [r.session_id for r in await a.load()] == ["s1"]
        assert [r.session_id for r in await b.load()] == ["s2"]
        await b.update("s1", state="lost", lost_reason="not yours")
        await b.remove("s1")
        with pytest.raises(StoreError, match="recorded for host 'host-a'"):
            await b.put(record("s1", tenant="mallory"))
        (s1,) = await a.load()
        assert (s1.state, s1.tenant, s1.lost_reason) == (SandboxState.RUNNING, "alice", None)
        rows = admin(fresh_postgres_url, "SELECT session_id, host_id, kernel_id FROM sandboxes ORDER BY session_id")
        assert rows == [("s1", "host-a", "k-s1"), ("s2", "host-b", "k-s2")]
    finally:
        await a.close()
        await b.close()


async def test_the_kernel_id_column_follows_the_record(fresh_postgres_url):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    catalog = ClusterCatalog(store, "h1")
    try:
        await catalog.register("http://10.0.0.1:8888", ["runc"], 10)
        await store.put(record("s1", tenant="alice"))
        host, tenant, session_id = await catalog.owner_of_kernel("k-s1")
        assert (host.host_id, tenant, session_id) == ("h1", "alice", "s1")
        paused = {"paused": {"bytes": 10}, "profile": "default"}  # gateway/snapshots.py: no kernel runs
        await store.update("s1", kernel=paused, state="paused")
        assert await catalog.owner_of_kernel("k-s1") is None
        await store.update("s1", kernel={"kernel_id": "k-new"}, state="running")
        assert (await catalog.owner_of_kernel("k-new"))[2] == "s1"
        await store.put(record("p1", kind="pool"))  # a pooled sandbox belongs to no tenant: never routed
        assert await catalog.owner_of_kernel("k-p1") is None and await catalog.owner("p1") is None
        assert await catalog.owner_of_kernel("nope") is None
    finally:
        await store.close()


HOSTILE = {
    "big": "x" * 5_000_000,
    "nul": "a\x00b",
    "surrogate": "\ud800 lone",
    "quotes": "'); DROP TABLE sandboxes; -- \" \\ $$ %s %(x)s {}",
    "unicode": "émoji 🐍 עברית \u202e rtl \ufeff",
    "numbers": [2**100, -0.0, 1e308, 5e-324, 0.1],
    "deep": [[[[[[[[[[{"k": None}]]]]]]]]]],
    "keys": {"": 1, "\x00": 2, "a.b": 3, "🔑": 4},
}


async def test_hostile_values_are_stored_and_read_back_exactly(fresh_postgres_url):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    try:
        odd_tenant = "tenant 'quoted' \"double\" 🐍 ; --"
        sent = record("s1", tenant=odd_tenant, gateway=HOSTILE, running={"code": HOSTILE["quotes"]})
        await store.put(sent)
        (back,) = await store.load()
        assert back.gateway == HOSTILE and back.tenant == odd_tenant and back.running == sent.running
        assert repr(back.gateway["numbers"]) == repr(HOSTILE["numbers"])  # -0.0 and the big int exactly
        await store.update("s1", lost_reason="why: " + HOSTILE["quotes"], kernel=HOSTILE)
        (back,) = await store.load()
        assert back.kernel == HOSTILE and back.lost_reason == "why: " + HOSTILE["quotes"]
        with pytest.raises(StoreError) as caught:  # PostgreSQL text cannot hold NUL: refused, not cut short
            await store.put(record("s2", tenant="nul\x00tenant"))
        assert "writing the session catalog" in str(caught.value)
        assert [r.session_id for r in await store.load()] == ["s1"]
    finally:
        await store.close()


async def test_a_newer_schema_is_refused_and_left_alone(fresh_postgres_url):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    await store.put(record("s1"))
    await store.close()
    admin(
        fresh_postgres_url,
        "UPDATE sandkernel_meta SET value = %s WHERE key = 'schema_version'",
        (str(SCHEMA_VERSION + 1),),
    )
    admin(fresh_postgres_url, "UPDATE sandkernel_meta SET value = '9.4.0' WHERE key = 'migrated_by'")
    with pytest.raises(StoreError) as caught:
        await PostgresStore.open(fresh_postgres_url, "h1")
    message = str(caught.value)
    assert f"schema version {SCHEMA_VERSION + 1}, written by sandkernel 9.4.0" in message and "Nothing was" in message
    assert admin(fresh_postgres_url, "SELECT session_id FROM sandboxes") == [("s1",)]


async def test_migrations_run_in_one_transaction_and_a_foreign_database_is_refused(fresh_postgres_url):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    await store.put(record("s1"))
    await store.close()
    step = SCHEMA_VERSION + 1
    failing = {**MIGRATIONS, step: ("ALTER TABLE sandboxes ADD COLUMN note TEXT", "THIS IS NOT SQL")}
    with pytest.raises(StoreError, match="rolled back, nothing was changed"):
        await PostgresStore.open(fresh_postgres_url, "h1", migrations=failing, schema_version=step)
    columns = {
        r[0]
        for r in admin(
            fresh_postgres_url, "SELECT column_name FROM information_schema.columns WHERE table_name = 'sandboxes'"
        )
    }
    assert "note" not in columns
    working = {**MIGRATIONS, step: ("ALTER TABLE sandboxes ADD COLUMN note TEXT",)}
    store = await PostgresStore.open(fresh_postgres_url, "h1", migrations=working, schema_version=step)
    assert [r.session_id for r in await store.load()] == ["s1"]
    await store.close()
    assert admin(fresh_postgres_url, "SELECT value FROM sandkernel_meta WHERE key = 'schema_version'") == [(str(step),)]

    admin(fresh_postgres_url, "DROP TABLE sandkernel_meta")  # our tables, but not our version table
    with pytest.raises(StoreError, match="not a sandkernel catalog"):
        await PostgresStore.open(fresh_postgres_url, "h1")


async def test_two_gateways_starting_together_migrate_once(fresh_postgres_url):
    stores = await asyncio.gather(*(PostgresStore.open(fresh_postgres_url, f"h{i}") for i in range(4)))
    for store in stores:
        await store.close()
    assert admin(fresh_postgres_url, "SELECT value FROM sandkernel_meta WHERE key = 'schema_version'") == [
        (str(SCHEMA_VERSION),)
    ]


def assert_no_password(err: BaseException, password: str) -> None:
    shown = "".join(traceback.format_exception(err)) + repr(err)
    assert password not in shown, shown


async def test_an_unreachable_catalog_fails_fast_without_the_password(postgres_server: PostgresServer):
    password = postgres_server.password
    closed_port = postgres_server.url("nothere").replace(f":{postgres_server.port}/", f":{free_port()}/")
    start = time.monotonic()
    with pytest.raises(CatalogUnavailableError) as caught:
        await PostgresStore.open(closed_port, "h1")
    # At once, not after libpq's connect timeout: a refusal on loopback takes milliseconds, so
    # CONNECT_TIMEOUT itself is the bound (a client that waited it out would reach it).
    assert time.monotonic() - start < CONNECT_TIMEOUT, "a refused connection must fail at once"
    assert caught.value.status == 503 and "Check --catalog-url" in str(caught.value)
    assert "sandkernel@127.0.0.1" in str(caught.value)  # says where, without the password
    assert_no_password(caught.value, password)

    wrong = postgres_server.url().replace(password, "not-the-password-" + password[:6])
    with pytest.raises(CatalogUnavailableError, match="password authentication failed") as caught:
        await PostgresStore.open(wrong, "h1")
    assert_no_password(caught.value, password[:6] + password[6:])
    assert "not-the-password" not in str(caught.value)

    with pytest.raises(StoreError) as caught:  # libpq cannot parse it: its message is not repeated
        await PostgresStore.open(f"postgresql://u:{password}@127.0.0.1:5432/db?sslmode=%zz{password}", "h1")
    assert_no_password(caught.value, password)
    with pytest.raises(StoreError, match="invalid port") as caught:  # the URL is quoted, its password is not
        await PostgresStore.open(f"postgresql://u:{password}@127.0.0.1:99999999/db", "h1")
    assert_no_password(caught.value, password)
    with pytest.raises(StoreError, match="must be a postgresql://"):
        await PostgresStore.open(f"mysql://u:{password}@127.0.0.1/db", "h1")
    with pytest.raises(StoreError, match="host id"):
        await PostgresStore.open(postgres_server.url(), "")


async def test_a_catalog_that_goes_away_fails_fast_and_a_broken_connection_is_replaced(fresh_postgres_url):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    try:
        await store.put(record("s1"))
        # PostgreSQL restarted under the pool: every connection of ours is cut; the next call retries once.
        ended = admin(
            fresh_postgres_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (application_name("h1"),),
        )
        assert len(ended) >= 2, ended  # the pool's connection and the host lock's
        assert [r.session_id for r in await store.load()] == ["s1"]
    finally:
        await store.close()

    with running_postgres() as server:  # a server of its own, to stop under an open store
        url = server.url()
        store = await PostgresStore.open(url, "h1")
        await store.put(record("s1"))
        password = server.password
    try:
        start = time.monotonic()
        with pytest.raises(CatalogUnavailableError) as caught:
            await store.load()
        took = time.monotonic() - start
        # Fast: the broken pooled connection, then a fresh one waited for UNREACHABLE_WAIT (1 s), not
        # the CONNECT_TIMEOUT (5 s) a call waits while the catalog looks reachable: 4 s of margin.
        assert took < CONNECT_TIMEOUT, f"a catalog that went away took {took:.1f} s to fail"
        assert_no_password(caught.value, password)
        start = time.monotonic()
        with pytest.raises(CatalogUnavailableError):  # and every call after it, as fast
            await store.put(record("s2"))
        assert time.monotonic() - start < CONNECT_TIMEOUT
    finally:
        await store.close()


# -- the cluster: hosts, placement, tenants' limits, hosts going down --------------------------


async def open_hosts(url: str, *host_ids: str) -> tuple[list[PostgresStore], list[ClusterCatalog]]:
    stores = [await PostgresStore.open(url, host_id) for host_id in host_ids]
    return stores, [ClusterCatalog(store, store.host_id) for store in stores]


async def close_all(stores: list[PostgresStore]) -> None:
    for store in stores:
        await store.close()


async def test_hosts_register_heartbeat_and_leave(fresh_postgres_url):
    stores, (h1, h2) = await open_hosts(fresh_postgres_url, "h1", "h2")
    try:
        before = admin(fresh_postgres_url, "SELECT now()")[0][0]
        await h1.register("http://10.0.0.1:8888", ["runc", "runsc"], 100)
        await h2.register("http://10.0.0.2:8888", ("runc",), 50)
        await h1.heartbeat(sessions=7, free=93)
        hosts = await h1.hosts()
        assert [h.host_id for h in hosts] == ["h1", "h2"]
        one = hosts[0]
        assert isinstance(one, HostInfo) and one.runtimes == ("runc", "runsc") and one.url == "http://10.0.0.1:8888"
        assert (one.capacity, one.sessions, one.free, one.status) == (100, 7, 93, "up")
        assert one.heartbeat_at >= before and one.heartbeat_at.tzinfo is not None  # the server's clock
        await h2.leave()
        assert [h.host_id for h in await h1.hosts()] == ["h1"]
        assert {h.host_id: h.status for h in await h1.hosts(up_only=False)} == {"h1": "up", "h2": "stopping"}
        await h2.register("http://10.0.0.2:9999", ["runc"], 60)  # restarted: up again, new address
        (again,) = [h for h in await h1.hosts() if h.host_id == "h2"]
        assert (again.url, again.capacity, again.status) == ("http://10.0.0.2:9999", 60, "up")
        stranger = ClusterCatalog(stores[0], "never-registered")
        with pytest.raises(StoreError, match="not registered"):
            await stranger.heartbeat(0, 0)
        with pytest.raises(ValueError):
            await h1.register("http://x", [], 1)
    finally:
        await close_all(stores)


async def test_placement_picks_the_most_free_host_that_has_the_runtime(fresh_postgres_url):
    stores, (a, b, c, d) = await open_hosts(fresh_postgres_url, "a", "b", "c", "d")
    try:
        await a.register("http://a", ["runc", "runsc"], 10)
        await b.register("http://b", ["runc"], 10)
        await c.register("http://c", ["runc", "runsc"], 100)
        await d.register("http://d", ["runc", "runsc"], 100)
        await a.heartbeat(sessions=8, free=2)
        await b.heartbeat(sessions=0, free=10)
        await c.heartbeat(sessions=0, free=50)
        await d.heartbeat(sessions=0, free=90)
        await d.leave()  # most free, but stopping: never chosen
        assert (await a.place("runc")).host_id == "c"
        await c.heartbeat(sessions=50, free=0)  # full: never chosen
        assert (await a.place("runsc")).host_id == "a"  # b has more room but no gVisor
        assert (await a.place("runc")).host_id == "b"
        chosen = [(await a.place("runc")).host_id for _ in range(10)]  # each place takes one off free
        assert chosen.count("b") == 9 and chosen.count("a") == 1
        assert await a.place("runc") is None  # every host full
        assert await a.place("kata") is None
    finally:
        await close_all(stores)


async def test_concurrent_placements_all_find_the_host_with_room(fresh_postgres_url):
    """Placements at once wait for each other instead of skipping the locked host (with SKIP
    LOCKED, 1 to 5 of 8 found "no room" while one host had room for 100); at a host's last
    place, the one that waited on it goes to the next host. Repeated: a placement that locked
    the host's row twice deadlocked in about 1 of 13 such bursts (a 503)."""
    stores, (a, b) = await open_hosts(fresh_postgres_url, "a", "b")
    try:
        await asyncio.gather(*(store.run(lambda conn: conn.execute("SELECT pg_sleep(0.2)")) for store in stores * 8))
        await a.register("http://a", ["runc"], 100)
        for round_ in range(3):
            await a.heartbeat(sessions=0, free=100)
            placed = await asyncio.gather(*(a.place("runc") for _ in range(8)))
            assert [host.host_id if host else None for host in placed] == ["a"] * 8
            # Their creates reach the host at once: each lets go of its own placement.
            await asyncio.gather(*(a.reserve("alice", None, f"s{round_}-{i}") for i in range(8)))
        assert admin(fresh_postgres_url, "SELECT count(*) FROM placements") == [(0,)]
        for _ in range(40):
            admin(fresh_postgres_url, "DELETE FROM placements")  # the last burst's creates arrived
            await a.heartbeat(sessions=97, free=3)
            await b.register("http://b", ["runc"], 2)
            placed = await asyncio.gather(*(a.place("runc") for _ in range(8)))
            assert sorted(host.host_id if host else "-" for host in placed) == ["-"] * 3 + ["a"] * 3 + ["b"] * 2
    finally:
        await close_all(stores)


async def room(catalog: ClusterCatalog) -> dict[str, tuple[int, int]]:
    """Each up host's (sessions, free) as the catalog has them."""
    return {h.host_id: (h.sessions, h.free) for h in await catalog.hosts()}


async def test_a_heartbeat_counts_the_creates_still_on_their_way(fresh_postgres_url):
    """A heartbeat between a placement and its create's arrival reports a count without that
    create; the room it reports is taken down by the placements still on their way (it replaced
    the placements' decrement, and a full host was given a third session)."""
    stores, (a, b) = await open_hosts(fresh_postgres_url, "a", "b")
    try:
        await a.register("http://a", ["runc"], 2)
        assert [(await a.place("runc")).host_id for _ in range(2)] == ["a", "a"]
        await a.heartbeat(sessions=0, free=2)  # neither create has reached host a yet
        assert await room(a) == {"a": (2, 0)}
        assert await b.place("runc") is None  # a is full: its two sessions are coming

        await b.register("http://b", ["runc"], 5)
        assert (await a.place("runc")).host_id == "b"
        await a.reserve("alice", 5, "s1")  # the first create arrives at a and is counted there
        await a.heartbeat(sessions=1, free=1)
        assert await room(a) == {"a": (2, 0), "b": (1, 4)}
        await a.reserve("alice", None, "s2")  # the second (no limit: still an arrival)
        await a.heartbeat(sessions=2, free=0)
        assert (await room(a))["a"] == (2, 0)
        assert admin(fresh_postgres_url, "SELECT host_id FROM placements") == [("b",)]

        await b.heartbeat(sessions=0, free=5)  # b's create never came (its forward failed) ...
        assert (await room(a))["b"] == (1, 4)
        admin(fresh_postgres_url, "UPDATE placements SET expires_at = now() - interval '1 second'")
        await b.heartbeat(sessions=0, free=5)  # ... and once it expired, b has its room back
        assert (await room(a))["b"] == (0, 5)
        assert admin(fresh_postgres_url, "SELECT count(*) FROM placements") == [(0,)]
    finally:
        await close_all(stores)


async def test_tenant_limits_hold_across_hosts_under_concurrency(fresh_postgres_url):
    stores, (h1, h2) = await open_hosts(fresh_postgres_url, "h1", "h2")
    try:
        # Grow both pools first, so the 20 reserves really run at once on 16 connections (without
        # the tenant's lock, this test sees more than 5 win).
        await asyncio.gather(*(store.run(lambda conn: conn.execute("SELECT pg_sleep(0.2)")) for store in stores * 8))
        attempts = [(h1 if i % 2 else h2).reserve("alice", 5, f"s{i}") for i in range(20)]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        won = [f"s{i}" for i, r in enumerate(results) if r is None]
        refused = [r for r in results if isinstance(r, TooManySessionsError)]
        assert len(won) == 5 and len(refused) == 15, results
        assert refused[0].status == 429 and "across the cluster" in str(refused[0])
        await h2.reserve("bob", 5, "bob-1")  # another tenant has its own count
        await h1.reserve("alice", 5, won[0])  # the same session again: no second place

        # A reserved session's record replaces its reservation (no double count); a released one frees a place.
        owner = {f"s{i}": (stores[0] if i % 2 else stores[1]) for i in range(20)}
        await owner[won[0]].put(record(won[0], tenant="alice"))
        with pytest.raises(TooManySessionsError):
            await h1.reserve("alice", 5, "late-1")
        await (h1 if owner[won[1]] is stores[0] else h2).release(won[1])
        await h1.reserve("alice", 5, "late-1")
        with pytest.raises(TooManySessionsError):
            await h2.reserve("alice", 5, "late-2")
        await owner[won[0]].update(won[0], state="lost", lost_reason="gone")  # a lost session counts until deleted
        with pytest.raises(TooManySessionsError):
            await h2.reserve("alice", 5, "late-2")
        await owner[won[0]].remove(won[0])
        await h2.reserve("alice", 5, "late-2")
        await h2.reserve("alice", None, "unlimited")  # no limit: nothing to count
        admin(
            fresh_postgres_url,
            "UPDATE reservations SET expires_at = now() - interval '1 second' WHERE session_id = 'late-2'",
        )  # a creator that died: its place comes back
        await h1.reserve("alice", 5, "late-3")
        assert admin(fresh_postgres_url, "SELECT count(*) FROM reservations WHERE tenant = 'alice'") == [(5,)]
    finally:
        await close_all(stores)


async def test_a_silent_host_is_marked_down_and_its_running_sessions_lost(fresh_postgres_url):
    stores, (me, gone, live) = await open_hosts(fresh_postgres_url, "me", "gone", "live")
    _, s_gone, s_live = stores
    try:
        for catalog in (me, gone, live):
            await catalog.register(f"http://{catalog.host_id}", ["runc"], 10)
        await s_gone.put(record("g-run", tenant="alice"))
        await s_gone.put(record("g-paused", tenant="alice", state="paused", kernel={"paused": {"bytes": 1}}))
        await s_gone.put(record("g-lost", tenant="bob", state="lost", lost_reason="OOM killed"))
        await s_gone.put(record("g-pool", kind="pool"))
        await s_live.put(record("l-run", tenant="alice"))
        await gone.reserve("alice", 10, "g-starting")
        admin(
            fresh_postgres_url,
            "INSERT INTO placements (host_id, expires_at) VALUES ('gone', now() + interval '1 minute')",
        )  # a create on its way to it
        # Its heartbeat stopped a minute ago (the server's clock); the others' are fresh.
        admin(fresh_postgres_url, "UPDATE hosts SET heartbeat_at = now() - interval '1 minute' WHERE host_id = 'gone'")
        admin(fresh_postgres_url, "UPDATE hosts SET heartbeat_at = now() - interval '1 minute' WHERE host_id = 'me'")
        last_beat = admin(fresh_postgres_url, "SELECT heartbeat_at FROM hosts WHERE host_id = 'gone'")[0][0]

        # Two gateways notice at once: one transaction each, the host goes down once. A host never
        # marks itself down ("me" is stale too, but it is the one asking).
        results = await asyncio.gather(me.mark_down_stale(20), me.mark_down_stale(20))
        assert sorted(results) == [[], ["gone"]]
        assert await live.mark_down_stale(20) == ["me"]
        await me.heartbeat(sessions=0, free=10)  # back: up again

        records = {r.session_id: r for r in await s_gone.load()}
        stamp = last_beat.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        assert records["g-run"].state is SandboxState.LOST
        assert records["g-run"].lost_reason == f"host gone stopped answering at {stamp}"
        assert (records["g-paused"].state, records["g-paused"].lost_reason) == (SandboxState.PAUSED, None)
        assert (records["g-lost"].state, records["g-lost"].lost_reason) == (SandboxState.LOST, "OOM killed")
        assert records["g-pool"].state is SandboxState.RUNNING  # the pool is the host's own business
        assert [(r.session_id, r.state) for r in await s_live.load()] == [("l-run", SandboxState.RUNNING)]
        assert admin(fresh_postgres_url, "SELECT session_id FROM reservations") == []
        assert admin(fresh_postgres_url, "SELECT id FROM placements") == []
        assert {h.host_id for h in await me.hosts()} == {"me", "live"}
        assert (await me.place("runc")).host_id != "gone"

        await gone.heartbeat(sessions=3, free=7)  # it comes back: up, but what was lost stays lost
        assert {h.host_id for h in await me.hosts()} == {"me", "live", "gone"}
        assert (await s_gone.load())[0].state is SandboxState.LOST
        host, tenant = await live.owner("g-run")
        assert (host.host_id, host.status, tenant) == ("gone", "up", "alice")
        assert await live.owner("nope") is None
    finally:
        await close_all(stores)


async def test_a_host_frozen_inside_a_catalog_transaction_is_still_marked_down(fresh_postgres_url):
    """A gateway stopped in the middle of its heartbeat's transaction (SIGSTOP, a hung VM) holds
    its host's row lock; the server ends that idle transaction, so the others still mark the host
    down. Before, every other gateway's look for quiet hosts waited on the lock until its
    statement timed out, at every beat, and the frozen host was never marked down."""
    stores, (me, frozen) = await open_hosts(fresh_postgres_url, "me", "frozen")
    stuck = asyncio.Event()

    async def freeze_holding_the_row(conn) -> None:
        await conn.execute("SELECT status FROM hosts WHERE host_id = 'frozen' FOR UPDATE")
        stuck.set()
        await asyncio.Event().wait()  # the gateway never runs again inside this transaction

    try:
        for catalog in (me, frozen):
            await catalog.register(f"http://{catalog.host_id}", ["runc"], 10)
        admin(
            fresh_postgres_url, "UPDATE hosts SET heartbeat_at = now() - interval '1 minute' WHERE host_id = 'frozen'"
        )
        holder = asyncio.create_task(frozen.store.run(freeze_holding_the_row))
        await stuck.wait()
        assert await me.mark_down_stale(20) == ["frozen"]
        assert admin(fresh_postgres_url, "SELECT status FROM hosts WHERE host_id = 'frozen'") == [("down",)]
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holder
        await frozen.heartbeat(sessions=0, free=10)  # thawed: its next beat gets through on a fresh connection
        assert admin(fresh_postgres_url, "SELECT status FROM hosts WHERE host_id = 'frozen'") == [("up",)]
    finally:
        await close_all(stores)


async def test_a_tenants_sessions_are_listed_from_every_host(fresh_postgres_url):
    stores, (h1, _h2) = await open_hosts(fresh_postgres_url, "h1", "h2")
    try:
        await stores[0].put(record("a1", tenant="alice", created_at=1.0))
        await stores[1].put(record("a2", tenant="alice", created_at=2.0, state="paused"))
        await stores[1].put(record("b1", tenant="bob", created_at=0.5))
        await stores[1].put(record("p1", kind="pool", created_at=0.1))
        listed = await h1.tenant_sessions("alice")
        assert [(r.session_id, r.state) for r in listed] == [("a1", SandboxState.RUNNING), ("a2", SandboxState.PAUSED)]
        assert [r.session_id for r in await h1.tenant_sessions("bob")] == ["b1"]
        assert await h1.tenant_sessions("carol") == []
    finally:
        await close_all(stores)


# -- one gateway per host id: an advisory lock held for the store's lifetime ---------------------


def lock_holders(url: str, host_id: str) -> list[tuple[int, str]]:
    """(backend pid, application_name) of the sessions holding ``host_id``'s lock, as the server sees them."""
    return admin(
        url,
        "SELECT l.pid, a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::int4::oid AND l.objid = %s::int4::oid "
        "AND l.objsubid = 2",
        host_lock_key(host_id),
    )


def terminate(url: str, pid: int) -> None:
    """End a backend and wait until it is gone (its locks released): ``pg_terminate_backend``
    alone only signals it, and a loaded machine's backend may still hold the lock afterwards."""
    assert admin(url, "SELECT pg_terminate_backend(%s, 60000)", (pid,)) == [(True,)], f"backend {pid} did not end"


def counted(function, calls: list):
    """``function`` (a coroutine function), appending each call's arguments to ``calls``."""

    async def wrapper(*args, **kwargs):
        calls.append(args)
        return await function(*args, **kwargs)

    return wrapper


async def test_a_second_store_with_the_same_host_id_is_refused_naming_the_first(fresh_postgres_url, monkeypatch):
    first = await PostgresStore.open(fresh_postgres_url, "h1")
    other = None
    try:
        await first.put(record("s1"))
        with pytest.raises(HostIdInUseError) as caught:
            await PostgresStore.open(fresh_postgres_url, "h1")
        message = str(caught.value)
        assert caught.value.status == 503 and caught.value.code == "host_id_in_use"
        assert "another gateway runs with host id 'h1'" in message and "--host-id" in message, message
        assert repr(application_name("h1")) in message and "from 127.0.0.1:" in message, message
        ((pid, name),) = lock_holders(fresh_postgres_url, "h1")  # still the first's, nothing else changed
        assert name == application_name("h1") and f"backend pid {pid}" in message
        assert [r.session_id for r in await first.load()] == ["s1"]

        other = await PostgresStore.open(fresh_postgres_url, "h2")  # another host id is its own
        assert [r.session_id for r in await other.load()] == []
    finally:
        await first.close()
        if other is not None:
            await other.close()
    assert lock_holders(fresh_postgres_url, "h1") == []  # let go on close, not when the server notices
    tries = []  # a freed host id is taken at the first try: no wait for a holder going away
    monkeypatch.setattr(pg_host_lock, "take_host_lock", counted(pg_host_lock.take_host_lock, tries))
    second = await PostgresStore.open(fresh_postgres_url, "h1")
    try:
        assert len(tries) == 1, "a freed host id was waited for"
        assert [r.session_id for r in await second.load()] == ["s1"]
    finally:
        await second.close()


async def test_a_lost_host_lock_is_taken_again_at_the_next_beat_and_one_taken_by_another_fences_the_store(
    fresh_postgres_url,
):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    catalog = ClusterCatalog(store, "h1")
    membership = ClusterMembership(
        catalog, host_id="h1", url="http://127.0.0.1:1", runtimes=["runc"], capacity=4,
        load=lambda: (0, 4), interval=60, down_after=60,
    )  # fmt: skip
    rival = None
    try:
        await catalog.register("http://127.0.0.1:1", ["runc"], 4)
        ((pid, _),) = lock_holders(fresh_postgres_url, "h1")
        terminate(fresh_postgres_url, pid)  # as a PostgreSQL restart would
        assert lock_holders(fresh_postgres_url, "h1") == []
        await membership.beat()
        ((again, name),) = lock_holders(fresh_postgres_url, "h1")
        assert again != pid and name == application_name("h1")

        # Lost again, and this time another gateway with this host id takes it before the beat.
        terminate(fresh_postgres_url, again)
        rival = await psycopg.AsyncConnection.connect(
            fresh_postgres_url, autocommit=True, application_name="sandkernel h1 4242@elsewhere"
        )
        taken = await rival.execute("SELECT pg_try_advisory_lock(%s::int4, %s::int4)", host_lock_key("h1"))
        assert await taken.fetchone() == (True,)
        (beat_at,) = admin(fresh_postgres_url, "SELECT heartbeat_at FROM hosts WHERE host_id = 'h1'")
        with pytest.raises(HostIdInUseError) as caught:
            await membership.beat()
        message = str(caught.value)
        assert "another gateway took it" in message and "'sandkernel h1 4242@elsewhere'" in message, message
        assert "--host-id" in message and store.fenced == message
        # Fenced: nothing it could overwrite of the other's, and no heartbeat that keeps 'h1' up for it.
        for call in (store.put(record("s9")), store.load(), catalog.place("runc"), membership.beat()):
            with pytest.raises(HostIdInUseError):
                await call
        assert admin(fresh_postgres_url, "SELECT heartbeat_at FROM hosts WHERE host_id = 'h1'") == [beat_at]
        assert admin(fresh_postgres_url, "SELECT session_id FROM sandboxes") == []
    finally:
        await store.close()
        if rival is not None:
            ((_, name),) = lock_holders(fresh_postgres_url, "h1")
            assert name == "sandkernel h1 4242@elsewhere"  # the fenced store's close left the other's lock alone
            await rival.close()


async def test_a_gateway_started_on_a_host_id_in_use_exits_with_why_and_changes_nothing(tmp_path, fresh_postgres_url):
    url = fresh_postgres_url
    a, b = Serve(tmp_path / "a", "runc"), Serve(tmp_path / "b", "runc")
    ids: list[str] = []
    try:
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))
        session = await a.create()
        ids.append(session["id"])
        hosts_before = rows(url, "SELECT host_id, url, status, started_at FROM hosts")
        sandboxes_before = rows(url, "SELECT session_id, host_id, state, updated_at FROM sandboxes")

        proc = b.launch(*cluster_flags(tmp_path, url, "host-a", b))  # the same --host-id, another gateway
        returncode = await asyncio.to_thread(proc.wait, 60)
        assert returncode != 0, b.output
        assert "another gateway runs with host id 'host-a'" in b.output and "--host-id" in b.output, b.output
        assert a.proc is not None and f" {a.proc.pid}@" in b.output, b.output  # names the first gateway
        assert "sandkernel gateway at" not in b.output
        b.proc = None  # it never ran: nothing of it to clean up

        assert rows(url, "SELECT host_id, url, status, started_at FROM hosts") == hosts_before
        assert rows(url, "SELECT session_id, host_id, state, updated_at FROM sandboxes") == sandboxes_before
        assert container_ids_of(session["id"]), "the refused gateway reaped the first one's sandbox"
        assert (await a.execute(session["id"], "print('still mine')"))["text"] == "still mine\n"
    finally:
        await clean_up_hosts((a, ids), (b, []))


# -- the registry: a session the cluster declared lost ------------------------------------------


async def test_a_session_declared_lost_answers_lost_from_the_moment_it_stops_being_live(tmp_path, fresh_postgres_url):
    store = await PostgresStore.open(fresh_postgres_url, "h1")
    registry = SessionRegistry(GatewaySettings(notebook_dir=tmp_path / "notebooks"), store=store)
    letting_go: asyncio.Task[int] | None = None
    try:
        managed = await registry.create("alice")
        reason = "host h1 stopped answering at 2026-12-01T20:00:00.000Z"
        await store.update(managed.id, state=SandboxState.LOST.value, lost_reason=reason)  # what mark_down_stale does
        letting_go = asyncio.create_task(registry.declare_lost())
        while managed.id in registry.live_ids():  # each turn of the loop: what a request in between sees
            await asyncio.sleep(0)
        assert not letting_go.done(), "the sandbox was let go before a request could look"
        with pytest.raises(SandboxLostError, match="stopped answering"):  # 410, never a 404 in between
            registry.get("alice", managed.id)
        assert await letting_go == 1
        assert registry.find("alice", managed.id).session_model()["state"] == "lost"
        assert not container_ids_of(managed.id)
    finally:
        if letting_go is not None:  # a failed check must not leave the sandbox it is removing
            with contextlib.suppress(Exception):
                await letting_go
        await registry.shutdown_all()
        await store.close()
