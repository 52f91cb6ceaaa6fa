"""The session catalog: every sandbox a gateway is answerable for, in a file that outlives it.

The gateway writes a :class:`~.records.SandboxRecord` before it hands a session out, and a
later process (after a crash, ``kill -9``, an upgrade) reads them back to re-adopt the
sandboxes. :class:`SessionStore` is the small interface the gateway and the warm pool use;
:class:`SqliteStore` implements it on one embedded SQLite file, ``state_dir()/catalog.sqlite3``
(a later backend, PostgreSQL for several gateways, implements the same five methods).

Why each choice:

- **The file is 0600 before any secret is in it.** Records hold every kernel's HMAC key (who
  has it can run code in that sandbox). The file is created empty with mode 0600 (``O_EXCL |
  O_NOFOLLOW``) before SQLite opens it; SQLite gives its ``-wal`` and ``-shm`` files the mode
  of the database file, and the state dir is 0700 (``state_dir``). An existing catalog that is
  a symlink or another user's file is refused; one readable by others is narrowed to 0600.
- **Durable when ``put`` returns, even across ``kill -9``.** WAL journal with
  ``synchronous=NORMAL``: each write is its own transaction, committed to the WAL (in the
  kernel's page cache) before the call returns, so a process crash loses nothing that returned.
  A power loss or kernel panic may roll back the last few commits (never corrupt the file);
  those are the moments the sandboxes themselves die too. ``FULL`` would fsync every commit
  (measured in bench/catalog_writes.py) for no gain against the failure this exists for.
- **Never on the event loop.** Every SQLite call runs on ONE dedicated worker thread (a
  ``ThreadPoolExecutor(max_workers=1)``): one connection, used by one thread, in call order,
  so writes from one task land in the order they were made and the loop never waits on disk.
- **A damaged or newer file is never touched.** Before anything is written, the file is
  opened read-only and checked (``PRAGMA quick_check``, then its schema version). A file that
  is not SQLite, truncated or damaged, or that a newer sandkernel wrote, raises
  :class:`StoreError` saying which file, what is wrong and that nothing was changed or deleted:
  the sandboxes it lists are tenants' work, and only an operator may decide to give them up.
- **One process at a time.** Two gateways on one catalog would both adopt the same sandboxes
  and talk to the same kernels. The store holds an exclusive ``flock`` on ``catalog.sqlite3.lock``
  while it is open (the kernel drops it when the process dies, ``kill -9`` included); a second
  open raises StoreError naming the pid that holds it. Readers (the reaper) take no lock.
- **Upgrades migrate in one transaction.** The ``meta`` table holds the schema version and the
  sandkernel versions that created and last migrated the file. :data:`MIGRATIONS` maps each
  version to the steps that bring the schema from the version before it; on open, the missing
  steps run in order inside one ``BEGIN IMMEDIATE`` transaction, so a failing step leaves the
  file exactly as it was. Version 0 is an empty file (a new catalog): step 1 creates the tables.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sandkernel import __version__
from sandkernel.errors import ConfigError
from sandkernel.kernels.model.records import UPDATABLE_FIELDS, SandboxRecord, SandboxState
from sandkernel.kernels.sandbox.state_dir import state_dir
from sandkernel.pid_lock import LockHeldError, take_pid_lock

log = logging.getLogger(__name__)
T = TypeVar("T")

CATALOG_NAME = "catalog.sqlite3"
# In the state dir of a gateway whose catalog is a cluster's PostgreSQL: says so to any reader of
# the state dir (the reaper, `sandkernel reap`), which then cannot know which of its sandboxes
# are durable and must keep them all (:func:`read_session_ids`).
REMOTE_CATALOG_MARK = "catalog.remote"
SCHEMA_VERSION = 1
BUSY_TIMEOUT_SECONDS = 5.0  # another process reading the file (``sandkernel reap``) holds a lock briefly

# A migration step: SQL statements run in order, or a function given the connection. Either runs
# inside the open's transaction and must not commit.
Migration = Sequence[str] | Callable[[sqlite3.Connection], None]

MIGRATIONS: dict[int, Migration] = {
    1: (
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE sandboxes (
            session_id  TEXT PRIMARY KEY,
            kind        TEXT NOT NULL,
            state       TEXT NOT NULL,
            tenant      TEXT,
            kernel      TEXT NOT NULL,   -- JSON: KernelSession.durable_state(), holds the HMAC key
            gateway     TEXT NOT NULL,   -- JSON: the gateway registry's own entry
            running     TEXT,            -- JSON: the execution in flight, or NULL
            lost_reason TEXT,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL
        )""",
    ),
}

_JSON_FIELDS = frozenset({"kernel", "gateway", "running"})
_COLUMNS = tuple(field.name for field in dataclasses.fields(SandboxRecord))  # the table has one column per field


class StoreError(ConfigError):
    """The catalog cannot be used: a damaged file, one from a newer sandkernel, a file that is not
    ours, or a write that failed. The message names the file and says what to do; nothing in the
    catalog was changed or deleted because of it."""

    status = 500
    code = "catalog_unavailable"


class SessionStore(Protocol):
    """Where the gateway records its sandboxes. Every method is async and durable when it
    returns; an implementation never blocks the event loop."""

    async def put(self, record: SandboxRecord) -> None:
        """Insert or replace the record of ``record.session_id``."""

    async def update(self, session_id: str, **fields: Any) -> None:
        """Change some of state/tenant/gateway/running/lost_reason/kernel of one record. A record
        that is not there (removed meanwhile) stays absent: an update never re-creates one."""

    async def remove(self, session_id: str) -> None:
        """Forget one record (no error if it is not there)."""

    async def load(self) -> list[SandboxRecord]:
        """Every record, oldest first."""

    async def close(self) -> None:
        """Let go of the backend (idempotent); later calls raise StoreError."""


def mark_remote_catalog(directory: Path | None = None) -> None:
    """Mark ``directory`` (default: the state dir) as one whose catalog is a cluster's PostgreSQL,
    so a reaper on this engine keeps the sandboxes labelled with it while its gateway is away
    (blocking: a few bytes, once at start-up). Idempotent."""
    mark = (directory or state_dir()) / REMOTE_CATALOG_MARK
    text = "the session catalog of this state dir is a cluster's PostgreSQL catalog (sandkernel serve --catalog-url)\n"
    fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def default_catalog_path() -> Path:
    """``state_dir()/catalog.sqlite3`` (creates the state dir 0700 if needed)."""
    return state_dir() / CATALOG_NAME


def open_store(
    path: str | os.PathLike[str] | None = None,
    *,
    migrations: Mapping[int, Migration] | None = None,
    schema_version: int = SCHEMA_VERSION,
) -> SqliteStore:
    """Open (creating if needed) the catalog at ``path`` (default :func:`default_catalog_path`).

    Blocks while the file is checked and migrated (a few milliseconds): call it at start-up
    before serving, or from async code through ``asyncio.to_thread``. Raises :class:`StoreError`
    for a file that is damaged, newer than this code, or not ours. ``migrations`` and
    ``schema_version`` replace the built-in ones (tests of the migration runner).
    """
    store = SqliteStore(
        Path(path) if path is not None else default_catalog_path(),
        migrations=MIGRATIONS if migrations is None else migrations,
        schema_version=schema_version,
    )
    try:
        store._executor.submit(store._open).result()
    except BaseException:
        store._executor.shutdown(wait=True)
        raise
    return store


class SqliteStore:
    """:class:`SessionStore` on one SQLite file; see the module docstring for why it is built so."""

    def __init__(self, path: Path, *, migrations: Mapping[int, Migration], schema_version: int) -> None:
        self.path = path
        self._migrations = migrations
        self._schema_version = schema_version
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandkernel-catalog")
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._closed = False

    # -- the five calls (run on the worker thread) ------------------------------------------

    async def put(self, record: SandboxRecord) -> None:
        row = _row(record, updated_at=time.time())
        sql = f"INSERT OR REPLACE INTO sandboxes ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
        await self._call(self._execute, sql, row)

    async def update(self, session_id: str, **fields: Any) -> None:
        values = update_values(fields)
        if not values:
            return
        assignments = ", ".join(f"{name} = ?" for name in values)
        sql = f"UPDATE sandboxes SET {assignments} WHERE session_id = ?"
        await self._call(self._execute, sql, (*values.values(), session_id))

    async def remove(self, session_id: str) -> None:
        await self._call(self._execute, "DELETE FROM sandboxes WHERE session_id = ?", (session_id,))

    async def load(self) -> list[SandboxRecord]:
        return await self._call(self._select_all)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._close_connection)
        finally:
            self._executor.shutdown(wait=False)

    # -- plumbing ----------------------------------------------------------------------------

    async def _call(self, func: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise StoreError(f"the session catalog {self.path} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(func, *args))

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"the session catalog {self.path} is closed")
        return self._conn

    def _execute(self, sql: str, params: Sequence[Any]) -> None:
        try:
            self._connection().execute(sql, params)
        except sqlite3.Error as err:
            raise StoreError(f"writing the session catalog {self.path} failed: {err}") from err

    def _select_all(self) -> list[SandboxRecord]:
        try:
            cursor = self._connection().execute(
                f"SELECT {', '.join(_COLUMNS)} FROM sandboxes ORDER BY created_at, session_id"
            )
            rows = cursor.fetchall()
        except sqlite3.Error as err:
            raise StoreError(f"reading the session catalog {self.path} failed: {err}") from err
        return records_from_rows(rows, str(self.path), "fix or delete that row, or move the file aside")

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _open(self) -> None:
        """Check the file read-only (a refused file is not touched, nor its lock file), take the
        lock, then open it for writing and bring its schema up to date (checked again under the
        write lock). On any failure nothing stays open."""
        try:
            created = _create_or_check_file(self.path)
            if not created and self.path.stat().st_size > 0:
                version, writer = _inspect_read_only(self.path)
                self._refuse_newer(version, writer)
            self._lock_fd = _lock(self.path)
            self._connect()
        except BaseException:
            self._close_connection()
            raise

    def _connect(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_SECONDS)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise StoreError(f"the session catalog {self.path} cannot use SQLite's WAL journal (got {mode!r})")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._migrate(conn)
        except sqlite3.DatabaseError as err:
            conn.close()
            raise _damaged(self.path, err) from err
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _refuse_newer(self, version: int, writer: str) -> None:
        if version > self._schema_version:
            raise StoreError(
                f"the session catalog {self.path} has schema version {version}, written by sandkernel {writer}; "
                f"this sandkernel {__version__} knows schema versions up to {self._schema_version}. "
                "Nothing was changed or deleted: run that sandkernel version (or newer) with this state dir, "
                "or start this one with another --state-dir."
            )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Apply the missing migration steps in one transaction (all of them, or none)."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version, writer = _schema_version(conn)
            self._refuse_newer(version, writer)  # a newer process may have migrated since the check
            if version < self._schema_version:
                try:
                    self._apply_steps(conn, version)
                except StoreError:
                    raise
                except Exception as err:
                    raise StoreError(
                        f"migrating the session catalog {self.path} from schema version {version} to "
                        f"{self._schema_version} failed ({err}); it was rolled back, nothing was changed"
                    ) from err
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    def _apply_steps(self, conn: sqlite3.Connection, version: int) -> None:
        for step in range(version + 1, self._schema_version + 1):
            migration = self._migrations.get(step)
            if migration is None:
                raise StoreError(
                    f"the session catalog {self.path} is at schema version {version} and this sandkernel has no "
                    f"migration to version {step}; nothing was changed"
                )
            if callable(migration):
                migration(conn)
            else:
                for sql in migration:
                    conn.execute(sql)
        meta = {"schema_version": str(self._schema_version), "migrated_by": __version__}
        if version == 0:
            meta["created_by"] = __version__
        conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta.items())
        log.info("session catalog %s: schema version %d -> %d", self.path, version, self._schema_version)


def read_session_ids(path: str | os.PathLike[str] | None = None) -> set[str]:
    """The session ids recorded in the catalog at ``path`` (default :func:`default_catalog_path`),
    read without writing it (blocking: for the reaper and the CLI). A missing file records
    nothing, unless the state dir is marked as a cluster gateway's (:func:`mark_remote_catalog`).
    That, a damaged file, or one a newer sandkernel wrote raises :class:`StoreError`: the caller
    cannot tell which sandboxes are durable, so it must not remove any."""
    catalog = Path(path) if path is not None else default_catalog_path()
    try:
        st = os.lstat(catalog)
    except FileNotFoundError:
        if os.path.lexists(catalog.parent / REMOTE_CATALOG_MARK):
            raise StoreError(
                f"the sessions of the state dir {catalog.parent} are recorded in a cluster's PostgreSQL catalog, "
                "which this command does not read; nothing was removed (stop or reap through that host's gateway)"
            ) from None
        return set()
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"the session catalog {catalog} is not a regular file; nothing was changed")
    if st.st_size == 0:
        return set()
    conn = _read_only_connection(catalog)
    try:
        version, writer = _inspect_read_only(catalog, conn)
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the session catalog {catalog} has schema version {version}, written by sandkernel {writer}; "
                f"this sandkernel {__version__} cannot read it (nothing was changed or deleted): use that version"
            )
        if version == 0:
            return set()
        return {row[0] for row in conn.execute("SELECT session_id FROM sandboxes")}
    except sqlite3.Error as err:
        raise _damaged(catalog, err) from err
    finally:
        conn.close()


def _lock(path: Path) -> int:
    """An exclusive flock on ``<catalog>.lock`` (0600), with this pid written in it; StoreError
    naming the holder's pid when another process has the catalog open."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock_path = Path(f"{path}.lock")
    try:
        return take_pid_lock(lock_path)
    except LockHeldError as held:
        raise StoreError(
            f"the session catalog {path} is in use by another process (pid {held.holder}): one gateway per state "
            "dir. Stop that gateway, or give this one another --state-dir; nothing was changed"
        ) from None


def _create_or_check_file(path: Path) -> bool:
    """Create the catalog empty and 0600 (True), or check that the existing one is a regular file
    of ours, narrowing its mode to 0600 (False). A symlink or another user's file is refused."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    else:
        os.close(fd)
        return True
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise StoreError(
            f"the session catalog {path} is not a regular file owned by this user (a symlink, a directory or "
            "another user's file); nothing was changed: remove or fix it, or choose another --state-dir"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o600)
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f"{path}{suffix}", 0o600)
    return False


def _read_only_connection(path: Path) -> sqlite3.Connection:
    """A connection that never writes the database file.

    With no ``-wal`` file beside it (no process has it open, none crashed with commits in the
    WAL), the file is opened ``immutable``, so not even an empty ``-wal``/``-shm`` is created
    next to a file that may be damaged; otherwise read-only through the WAL, to see its commits."""
    query = "mode=ro" if os.path.lexists(f"{path}-wal") else "immutable=1"
    uri = f"file:{urllib.parse.quote(str(path))}?{query}"
    try:
        return sqlite3.connect(uri, uri=True, isolation_level=None, timeout=BUSY_TIMEOUT_SECONDS)
    except sqlite3.Error as err:
        raise _damaged(path, err) from err


def _inspect_read_only(path: Path, conn: sqlite3.Connection | None = None) -> tuple[int, str]:
    """The schema version and its writer, read without writing after an integrity check
    (``PRAGMA quick_check``); raises StoreError for a damaged file."""
    own = conn is None
    conn = conn or _read_only_connection(path)
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise _damaged(path, "; ".join(problems[:3]))
        return _schema_version(conn)
    except sqlite3.DatabaseError as err:
        raise _damaged(path, err) from err
    finally:
        if own:
            conn.close()


def _schema_version(conn: sqlite3.Connection) -> tuple[int, str]:
    """(schema version, the sandkernel version that last migrated it); (0, "") for an empty file."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        tables = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        if tables:
            raise sqlite3.DatabaseError(f"tables {sorted(t[0] for t in tables)} but no meta table: not a catalog")
        return 0, ""
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    try:
        return int(meta["schema_version"]), meta.get("migrated_by", "(unknown version)")
    except (KeyError, ValueError) as err:
        raise sqlite3.DatabaseError(f"the meta table has no valid schema_version ({err})") from err


def _damaged(path: Path, why: object) -> StoreError:
    return StoreError(
        f"the session catalog {path} is damaged or not a sandkernel catalog ({why}). Nothing was changed or "
        f"deleted. Move it aside (`mv {path} {path}.damaged`, with its -wal and -shm files if any) and start "
        "again: the gateway then starts with an empty catalog and treats the sandboxes it listed as unknown "
        "(reaped when their owner is gone); keep the moved file to recover from."
    )


def update_values(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The column values of a ``SessionStore.update`` (empty when there is nothing to change):
    only :data:`UPDATABLE_FIELDS` (TypeError otherwise), encoded as stored, with ``updated_at``."""
    unknown = set(fields) - UPDATABLE_FIELDS
    if unknown:
        raise TypeError(f"a catalog update cannot change {sorted(unknown)}; allowed: {sorted(UPDATABLE_FIELDS)}")
    if not fields:
        return {}
    values = {name: _column_value(name, value) for name, value in fields.items()}
    values["updated_at"] = time.time()
    return values


def _column_value(name: str, value: Any) -> Any:
    if name in _JSON_FIELDS:
        if value is None:
            if name != "running":
                raise ValueError(f"a catalog record's {name} cannot be None")
            return None
        return json.dumps(value, separators=(",", ":"))
    if name == "state":
        return str(SandboxState(value))
    return value


def _row(record: SandboxRecord, *, updated_at: float) -> tuple[Any, ...]:
    values = {name: getattr(record, name) for name in _COLUMNS}
    values["updated_at"] = updated_at
    values["kind"] = str(record.kind)
    return tuple(_column_value(name, values[name]) for name in _COLUMNS)


def records_from_rows(rows: Sequence[Sequence[Any]], catalog: str, advice: str) -> list[SandboxRecord]:
    """Rows of ``SELECT <the record's columns>`` (:data:`_COLUMNS`, in order) as records, for
    both catalogs. A row that does not read (hand-edited: bad JSON, an unknown kind or state) is
    a StoreError naming ``catalog`` and the session, ending with ``advice`` (what to do about the
    row): never skipped, or its sandbox would be reaped as an orphan. Raised ``from None``: the
    message carries the cause, and no driver's text rides along in a logged traceback."""
    records = []
    for row in rows:
        try:
            records.append(_record(row))
        except (ValueError, TypeError) as err:
            raise StoreError(
                f"the session catalog {catalog} has an unreadable record for session {row[0]!r} ({err}); "
                f"nothing was changed or deleted: {advice}"
            ) from None
    return records


def _record(row: Sequence[Any]) -> SandboxRecord:
    values = dict(zip(_COLUMNS, row, strict=True))
    for name in _JSON_FIELDS:
        if values[name] is not None:
            values[name] = json.loads(values[name])
    return SandboxRecord(**values)
