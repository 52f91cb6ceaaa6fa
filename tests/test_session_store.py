"""The session catalog (kernels/durable/store.py): records survive the process that wrote them,
the file keeps the kernels' keys to its owner, and a damaged or newer catalog is refused without
a byte of it changing (pure tier: a real SQLite file and real processes, no Docker). The calls
every SessionStore answers alike run over both catalogs, the SQLite file and PostgreSQL
(``backend``: a throwaway server from tests/postgres_fixtures.py, in the docker tier with the
rest of the cluster's tests; what only PostgreSQL does is in tests/test_cluster_catalog.py). The
warm pool's records, and a pool closed during a refill, at the end (docker: over the runtimes)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import psycopg
import pytest

from sandkernel.gateway.cluster.pg_errors import CatalogAddress, CatalogUnavailableError, catalog_error
from sandkernel.gateway.cluster.postgres import PostgresStore
from sandkernel.kernels.durable import SCHEMA_VERSION, SandboxRecord, StoreError, open_store
from sandkernel.kernels.durable.store import (
    MIGRATIONS,
    REMOTE_CATALOG_MARK,
    SessionStore,
    default_catalog_path,
    mark_remote_catalog,
)
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.pool import WarmPool
from sandkernel.kernels.lifecycle.reaper import RecordedElsewhere, catalogued_session_ids, reap_sync
from sandkernel.kernels.model.profiles import resolve_profile
from sandkernel.kernels.model.records import SandboxKind, SandboxState
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, SESSION_LABEL, owner_label
from sandkernel.kernels.sandbox.state_dir import STATE_DIR_LABEL, use_state_dir

from .conftest import RUNTIME_PARAMS, container_ids_of, require_runtime


def record(session_id: str, **fields) -> SandboxRecord:
    kernel = {"container_id": "c" * 64, "connection": {"key": f"hmac-{session_id}", "shell_port": 5}}
    return SandboxRecord(session_id=session_id, kind=fields.pop("kind", "session"), kernel=kernel, **fields)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> dict[str, str]:
    return {p.name: digest(p) for p in sorted(directory.iterdir())}


async def filled_catalog(path: Path, count: int = 3) -> list[SandboxRecord]:
    store = open_store(path)
    records = [record(f"s{i}", tenant="alice", gateway={"kernel_name": "python3", "n": i}) for i in range(count)]
    for r in records:
        await store.put(r)
    await store.close()
    return records


@dataclass(frozen=True)
class Backend:
    """One SessionStore under the shared tests: ``open`` opens (again) the same catalog; ``edit``
    runs SQL on it behind the store's back, as a hand edit would."""

    open: Callable[[], Awaitable[SessionStore]]
    edit: Callable[[str], None]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.docker)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """The SQLite catalog, then PostgreSQL (a fresh database on the run's throwaway server)."""
    if request.param == "sqlite":
        path = tmp_path / "catalog.sqlite3"

        async def open_sqlite() -> SessionStore:
            return open_store(path)

        def edit_sqlite(sql: str) -> None:
            conn = sqlite3.connect(path)
            try:
                conn.execute(sql)
                conn.commit()
            finally:
                conn.close()

        return Backend(open_sqlite, edit_sqlite)
    import psycopg  # the cluster extra: only this backend needs it

    url = request.getfixturevalue("fresh_postgres_url")

    async def open_postgres() -> SessionStore:
        return await PostgresStore.open(url, "h1")

    def edit_postgres(sql: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql)

    return Backend(open_postgres, edit_postgres)


async def test_records_round_trip_update_and_remove(backend):
    store = await backend.open()
    try:
        first = record("a", tenant="alice", gateway={"created": 1.5, "metadata": {"x": [1, 2]}})
        pooled = record("b", kind="pool")
        await store.put(first)
        await store.put(pooled)
        loaded = {r.session_id: r for r in await store.load()}
        assert loaded["a"].kernel == first.kernel and loaded["a"].gateway == first.gateway
        assert (loaded["a"].tenant, loaded["a"].state, loaded["a"].running) == ("alice", SandboxState.RUNNING, None)
        assert loaded["b"].kind is SandboxKind.POOL and loaded["b"].tenant is None
        assert loaded["a"].created_at == first.created_at

        running = {"code": "import time; time.sleep(60)", "started_at": 12.5}
        await store.update("a", running=running, gateway={"last_activity": 9.0})
        (a,) = [r for r in await store.load() if r.session_id == "a"]
        assert a.running == running and a.gateway == {"last_activity": 9.0} and a.kernel == first.kernel
        assert a.updated_at >= a.created_at
        await store.update("a", state="lost", lost_reason="exit code 137 (OOM killed)", running=None)
        (a,) = [r for r in await store.load() if r.session_id == "a"]
        assert (a.state, a.lost_reason, a.running) == (SandboxState.LOST, "exit code 137 (OOM killed)", None)

        await store.put(record("b", kind="session", tenant="bob"))  # a pooled sandbox handed out: replaced
        (b,) = [r for r in await store.load() if r.session_id == "b"]
        assert b.kind is SandboxKind.SESSION and b.tenant == "bob"

        await store.remove("a")
        await store.remove("a")  # already gone: not an error
        await store.update("a", state="lost")  # a late update never brings a removed record back
        assert [r.session_id for r in await store.load()] == ["b"]
        with pytest.raises(TypeError, match="cannot change"):
            await store.update("b", kind="pool")
        with pytest.raises(ValueError):
            await store.update("b", state="zombie")
        with pytest.raises(ValueError):
            SandboxRecord("c", kind="spare", kernel={})
    finally:
        await store.close()
        await store.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        await store.load()
    with pytest.raises(StoreError, match="closed"):
        await store.put(record("c"))
    reopened = await backend.open()
    try:
        assert [(r.session_id, r.tenant) for r in await reopened.load()] == [("b", "bob")]
    finally:
        await reopened.close()


async def test_load_is_oldest_first(backend):
    store = await backend.open()
    try:
        for i, created in enumerate([30.0, 10.0, 20.0, 10.0]):
            await store.put(record(f"s{i}", created_at=created))
        assert [r.session_id for r in await store.load()] == ["s1", "s3", "s2", "s0"]
    finally:
        await store.close()


async def test_a_hand_edited_unreadable_record_is_named_not_skipped(backend):
    store = await backend.open()
    try:
        for i in range(3):
            await store.put(record(f"s{i}", tenant="alice"))
    finally:
        await store.close()
    backend.edit("UPDATE sandboxes SET kernel = '{not json' WHERE session_id = 's1'")
    store = await backend.open()
    try:
        with pytest.raises(StoreError, match=r"unreadable record for session 's1'.*nothing was changed or deleted"):
            await store.load()
    finally:
        await store.close()


async def write_many(store: SessionStore, count: int) -> None:
    """``count`` puts and as many updates, then a load that finds them all."""
    for i in range(count):
        await store.put(record(f"s{i}"))
        await store.update(f"s{i}", state="lost")
    assert len(await store.load()) == count


async def test_catalog_calls_leave_the_event_loop_free(backend):
    store = await backend.open()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        await write_many(store, 50)
    finally:
        task.cancel()
        await store.close()
    assert ticks >= 100, "the loop ran other tasks while the catalog wrote"


async def test_catalog_and_its_journal_are_the_owners_alone(tmp_path):
    use_state_dir(tmp_path / "state")
    try:
        store = open_store()
        path = default_catalog_path()
        assert path == tmp_path / "state" / "catalog.sqlite3"
        try:
            await store.put(record("a"))
            files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.parent.iterdir()}
            assert files == {
                "catalog.sqlite3": 0o600,
                "catalog.sqlite3-wal": 0o600,
                "catalog.sqlite3-shm": 0o600,
                "catalog.sqlite3.lock": 0o600,
            }
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        finally:
            await store.close()
    finally:
        use_state_dir(None)


async def test_a_catalog_readable_by_others_is_narrowed_and_a_symlink_refused(tmp_path):
    path = tmp_path / "catalog.sqlite3"
    await filled_catalog(path)
    os.chmod(path, 0o644)
    store = open_store(path)
    await store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    target = tmp_path / "elsewhere"
    target.write_text("not yours")
    link = tmp_path / "link" / "catalog.sqlite3"
    link.parent.mkdir()
    link.symlink_to(target)
    with pytest.raises(StoreError, match="not a regular file owned by this user"):
        open_store(link)
    assert target.read_text() == "not yours"


async def test_one_process_at_a_time_has_the_catalog_open(tmp_path):
    path = tmp_path / "catalog.sqlite3"
    store = open_store(path)
    try:
        with pytest.raises(StoreError, match=f"in use by another process \\(pid {os.getpid()}\\)"):
            open_store(path)
        await store.put(record("a"))  # the refused open took nothing from the one that has it
    finally:
        await store.close()
    again = open_store(path)  # closed: free again (a killed process frees it too, see below)
    try:
        assert [r.session_id for r in await again.load()] == ["a"]
    finally:
        await again.close()


CHILD = """
import asyncio, sys
from sandkernel.kernels.durable import SandboxRecord, open_store

async def main():
    store = open_store(sys.argv[1])
    i = 0
    while True:
        sid = f"s{i:05d}"
        await store.put(SandboxRecord(sid, "session", {"key": sid * 40}, gateway={"blob": "x" * 2000}))
        if i % 2:
            await store.update(f"s{i - 1:05d}", state="lost", lost_reason="r" + sid)
        print(sid, flush=True)
        i += 1

asyncio.run(main())
"""


def test_every_write_that_returned_survives_kill_9(tmp_path):
    path = tmp_path / "catalog.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        seen = [child.stdout.readline().strip() for _ in range(200)]  # the child is still writing
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        seen += child.stdout.read().split()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL and len(seen) >= 200

    async def load():
        store = open_store(path)  # also checks the file's integrity first
        try:
            return {r.session_id: r for r in await store.load()}
        finally:
            await store.close()

    records = asyncio.run(load())
    assert set(seen) <= set(records), f"writes lost: {sorted(set(seen) - set(records))[:5]}"
    for sid in seen:
        n = int(sid[1:])
        if n % 2 == 0 and f"s{n + 1:05d}" in seen:  # its update returned before that id was printed
            assert records[sid].state is SandboxState.LOST and records[sid].lost_reason == f"rs{n + 1:05d}"


def corrupt_not_sqlite(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a catalog" * 100)


def corrupt_truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def corrupt_page_overwritten(path: Path) -> None:
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page : 3 * page] = b"\xa5" * page  # the b-tree page after the schema and meta
    path.write_bytes(bytes(data))


def corrupt_foreign_database(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE photos (name TEXT)")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    "damage", [corrupt_not_sqlite, corrupt_truncated, corrupt_page_overwritten, corrupt_foreign_database]
)
async def test_a_damaged_catalog_is_refused_and_left_byte_identical(tmp_path, damage):
    path = tmp_path / "catalog.sqlite3"
    if damage is corrupt_foreign_database:
        path.touch(mode=0o600)
    else:
        await filled_catalog(path, count=40)  # several pages, so a truncation cuts through the records
        assert list(listing(tmp_path)) == ["catalog.sqlite3", "catalog.sqlite3.lock"]  # checkpointed on close
    damage(path)
    before = listing(tmp_path)
    with pytest.raises(StoreError) as caught:
        open_store(path)
    message = str(caught.value)
    assert str(path) in message and "Nothing was changed or deleted" in message and "Move it aside" in message
    assert listing(tmp_path) == before


async def test_a_catalog_from_a_newer_version_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "catalog.sqlite3"
    await filled_catalog(path)
    conn = sqlite3.connect(path)
    conn.executemany(
        "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
        [("schema_version", str(SCHEMA_VERSION + 1)), ("migrated_by", "9.4.0")],
    )
    conn.commit()
    conn.close()
    before = listing(tmp_path)
    with pytest.raises(StoreError) as caught:
        open_store(path)
    message = str(caught.value)
    assert f"schema version {SCHEMA_VERSION + 1}, written by sandkernel 9.4.0" in message
    assert "Nothing was changed or deleted" in message and str(path) in message
    assert listing(tmp_path) == before


def schema(path: Path) -> tuple[str, list[str]]:
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        columns = [row[1] for row in conn.execute("PRAGMA table_info(sandboxes)")]
        return version, columns
    finally:
        conn.close()


async def test_migrations_run_in_order_in_one_transaction(tmp_path):
    """A file at version 1 opened by code at version 3 gets steps 2 and 3; a failing step rolls
    every step back; a missing step is refused. (A test-only registry: version 1 is the first.)"""
    path = tmp_path / "catalog.sqlite3"
    records = await filled_catalog(path)
    assert schema(path)[0] == "1"

    def backfill(conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE sandboxes SET note = 'from ' || kind")

    failing = {**MIGRATIONS, 2: ("ALTER TABLE sandboxes ADD COLUMN note TEXT",), 3: ("THIS IS NOT SQL",)}
    with pytest.raises(StoreError, match="rolled back, nothing was changed"):
        open_store(path, migrations=failing, schema_version=3)
    version, columns = schema(path)
    assert version == "1" and "note" not in columns

    with pytest.raises(StoreError, match="no migration to version 2"):
        open_store(path, migrations=MIGRATIONS, schema_version=2)
    assert schema(path)[0] == "1"

    working = {**MIGRATIONS, 2: ("ALTER TABLE sandboxes ADD COLUMN note TEXT",), 3: backfill}
    store = open_store(path, migrations=working, schema_version=3)
    try:
        assert [r.session_id for r in await store.load()] == [r.session_id for r in records]
    finally:
        await store.close()
    version, columns = schema(path)
    assert version == "3" and "note" in columns
    conn = sqlite3.connect(path)
    assert {row[0] for row in conn.execute("SELECT note FROM sandboxes")} == {"from session"}
    conn.close()
    with pytest.raises(StoreError, match="schema version 3"):  # and this version's code now refuses it
        open_store(path)


async def test_an_empty_file_is_a_new_catalog(tmp_path):
    """Version 0 is an empty file (created 0600 before SQLite wrote to it): step 1 makes the tables."""
    path = tmp_path / "catalog.sqlite3"
    path.touch(mode=0o600)
    store = open_store(path)
    try:
        await store.put(record("a"))
        assert [r.session_id for r in await store.load()] == ["a"]
    finally:
        await store.close()
    assert schema(path)[0] == str(SCHEMA_VERSION)


async def test_sqlite_runs_on_one_worker_thread(tmp_path):
    """Every SQLite call on the store's one worker thread (a connection is not shared across
    threads), never the loop's (test_catalog_calls_leave_the_event_loop_free: the loop stays free)."""
    store = open_store(tmp_path / "catalog.sqlite3")
    threads: set[int] = set()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(
        store._executor, lambda: store._conn.set_trace_callback(lambda _sql: threads.add(threading.get_ident()))
    )
    try:
        await write_many(store, 20)
    finally:
        await store.close()
    assert len(threads) == 1 and threading.get_ident() not in threads


# -- the warm pool in the catalog (docker: parametrised over the runtimes) ---------------------


def our_containers() -> dict[str, str]:
    """This test process's sandbox containers: id -> session label (sparse: no inspect per container)."""
    found = default_engine().client.containers.list(
        all=True, sparse=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"}
    )
    return {c.id: (c.attrs.get("Labels") or {}).get(SESSION_LABEL, "") for c in found}


async def wait_for(condition, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (value := await condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return value


@pytest.mark.parametrize("moment", ["start just begun", "container created, kernel not ready"])
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_closing_the_pool_during_a_refill_leaves_no_sandbox(runtime, moment, tmp_path):
    require_runtime(runtime)
    before = await asyncio.to_thread(our_containers)
    store = open_store(tmp_path / "catalog.sqlite3")
    pool = WarmPool(1, resolve_profile(None, {"runtime": runtime}), store=store)
    try:
        pool.start()
        starting: set[str] = set()
        if moment == "start just begun":
            await asyncio.sleep(0)  # the filler's first step: KernelSession.start is under way
        else:

            async def new_container() -> dict[str, str]:
                now = await asyncio.to_thread(our_containers)
                return {cid: sid for cid, sid in now.items() if cid not in before}

            starting = set((await wait_for(new_container, "the pool's container")).values())
            assert len(pool) == 0, "the kernel was already up: the close would not race the start"
        await pool.close()
        after = await asyncio.to_thread(our_containers)
        assert set(after) <= set(before), f"the pool left sandboxes behind: {set(after) - set(before)}"
        for sid in starting:
            assert not await asyncio.to_thread(container_ids_of, sid)
        assert len(pool) == 0 and await store.load() == []
    finally:
        await pool.close()
        await store.close()


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_pooled_sandboxes_are_catalogued_until_handed_out(runtime, tmp_path):
    """Recorded as kind pool when up; forgotten when handed out; a detached pool leaves them
    running and recorded, and a new pool adopts them from their records."""
    require_runtime(runtime)
    store = open_store(tmp_path / "catalog.sqlite3")
    profile = resolve_profile(None, {"runtime": runtime})
    pool = WarmPool(2, profile, store=store)
    second = WarmPool(2, profile, store=store)
    handed: KernelSession | None = None
    try:
        pool.start()
        await pool.wait_full()
        assert len(pool) == 2
        records = {r.session_id: r for r in await store.load()}
        assert len(records) == 2 and {r.kind for r in records.values()} == {SandboxKind.POOL}
        for sid, r in records.items():
            assert await asyncio.to_thread(container_ids_of, sid), "a record for a sandbox that is not there"
            assert r.kernel and r.tenant is None and r.state is SandboxState.RUNNING

        handed = await pool.acquire()
        assert handed is not None and handed.id in records
        assert handed.id not in {r.session_id for r in await store.load()}, "a handed-out sandbox kept its pool record"
        await wait_for(lambda: asyncio.sleep(0, result=len(pool) == 2), "the refill")  # a third one started
        pooled = {r.session_id: r for r in await store.load()}
        assert len(pooled) == 2 and handed.id not in pooled

        await pool.detach()
        assert len(pool) == 0 and set(pooled) == {r.session_id for r in await store.load()}
        for sid in pooled:
            assert await asyncio.to_thread(container_ids_of, sid), "detach must leave pooled sandboxes running"

        adopted = [await KernelSession.adopt(sid, r.kernel) for sid, r in pooled.items()]
        assert [second.adopt(s) for s in adopted] == [True, True] and len(second) == 2
        again = await second.acquire()
        assert again is not None and again.id in pooled
        assert (await again.execute("1 + 1", timeout=60)).outputs[0]["data"]["text/plain"] == "2"
        await again.shutdown()
        await second.close()
        assert await store.load() == []
        for sid in pooled:
            assert not await asyncio.to_thread(container_ids_of, sid)
    finally:
        if handed is not None:
            await handed.shutdown()
        await pool.close()
        await second.close()
        await store.close()


# -- the reaper keeps catalogued sandboxes ------------------------------------------------------


async def test_catalogued_ids_come_from_the_catalog_and_an_unreadable_one_stops_reaping(tmp_path):
    use_state_dir(tmp_path / "state")
    try:
        assert catalogued_session_ids() == set()  # no catalog yet: nothing is durable
        store = open_store()
        await store.put(record("a"))
        await store.put(record("p", kind="pool"))
        assert catalogued_session_ids() == {"a", "p"}  # read while the writer has it open
        await store.close()
        path = default_catalog_path()
        assert catalogued_session_ids() == {"a", "p"}
        before = listing(path.parent)
        corrupt_page_overwritten(path)
        damaged = listing(path.parent)
        with pytest.raises(StoreError, match="damaged"):
            catalogued_session_ids()
        assert listing(path.parent) == damaged != before
        path.unlink()
        await filled_catalog(path)
        conn = sqlite3.connect(path)
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
        conn.commit()
        conn.close()
        with pytest.raises(StoreError, match="cannot read it"):  # a newer catalog: its ids are not guessed
            catalogued_session_ids()
    finally:
        use_state_dir(None)


def test_a_cluster_gateways_state_dir_is_never_taken_for_an_empty_catalog(tmp_path):
    """Its records are in PostgreSQL, not in a SQLite file there: a reaper that read "no catalog,
    nothing durable" would remove its sandboxes while it restarts. Its own gateway, which reads
    PostgreSQL, still decides for its own state dir."""
    state = tmp_path / "state"
    use_state_dir(state)
    try:
        assert catalogued_session_ids() == set()
        mark_remote_catalog()
        assert stat.S_IMODE((state / REMOTE_CATALOG_MARK).stat().st_mode) == 0o600
        with pytest.raises(StoreError, match="PostgreSQL"):
            catalogued_session_ids()  # `sandkernel reap` stops before removing anything
        labels = {SESSION_LABEL: "s1", STATE_DIR_LABEL: str(state)}
        assert RecordedElsewhere()(labels) is True  # any other reaper keeps it
        assert RecordedElsewhere(state)(labels) is False  # its gateway judges by the keep it read itself
    finally:
        use_state_dir(None)


def test_postgresql_driver_errors_become_the_catalogs_own_without_the_password():
    """One translation (gateway/cluster/pg_errors.py's catalog_error) for the store's calls, the
    host-id lock and the migration: a connection-level error is 503 (try again), a refused
    statement a StoreError, and neither quotes the password libpq echoed."""
    address = CatalogAddress("postgresql://sk:s%3Ecret@db.example:5433/catalog")
    said = 'connection to server failed: FATAL: password "s>cret" and "s%3Ecret" refused'
    failed = f"writing the session catalog {address.display} failed"

    down = catalog_error(address, psycopg.OperationalError(said), failed)
    assert type(down) is CatalogUnavailableError and down.status == 503
    assert str(down).startswith("writing the session catalog postgresql://sk@db.example:5433/catalog failed: ")
    opening = catalog_error(address, psycopg.OperationalError(said), failed, opening=True)
    assert type(opening) is CatalogUnavailableError and "Check --catalog-url" in str(opening)
    refused = catalog_error(address, psycopg.errors.UndefinedTable('relation "hosts" does not exist'), failed)
    assert type(refused) is StoreError and str(refused).endswith('failed: relation "hosts" does not exist')
    silent = catalog_error(address, psycopg.DataError(""), failed)
    assert str(silent).endswith("failed: DataError")
    for error in (down, opening):
        assert "cret" not in str(error) and "***" in str(error), error


@pytest.mark.docker
async def test_the_reaper_never_removes_a_catalogued_sandbox(tmp_path):
    path = tmp_path / "catalog.sqlite3"
    store = open_store(path)
    tag = secrets.token_hex(4)
    # An owner on another host: every gateway another worker starts meanwhile counts it alive and
    # leaves its containers alone (a dead owner of this host's would be reaped by the first of
    # them, catalogued or not: it is not in their catalogs); the reap below names it.
    owner = f"elsewhere-{tag}:1:1"
    engine = default_engine()

    def create(session_id: str):
        labels = {SESSION_LABEL: session_id, OWNER_LABEL: owner}
        return engine.client.containers.create(resolve_profile().image, labels=labels)

    durable, orphan = await asyncio.gather(
        asyncio.to_thread(create, f"durable-{tag}"), asyncio.to_thread(create, f"orphan-{tag}")
    )
    try:
        await store.put(record(f"durable-{tag}"))
        keep = await asyncio.to_thread(catalogued_session_ids, path)
        report = await asyncio.to_thread(reap_sync, engine, owner=owner, keep=keep)
        assert report.removed == (orphan.name,)
        assert await asyncio.to_thread(container_ids_of, f"durable-{tag}") == [durable.id]
        assert not await asyncio.to_thread(container_ids_of, f"orphan-{tag}")
    finally:
        await store.close()
        for c in (durable, orphan):
            with contextlib.suppress(docker.errors.NotFound):
                await asyncio.to_thread(c.remove, force=True)
