"""The gateway's audit stream: an append-only, rotated, hash-chained JSON Lines log.

One :class:`AuditLog` per gateway process, opened at start-up (:meth:`AuditLog.open`, blocking,
before the gateway listens) and closed when it stops. Callers on the event loop call
:meth:`AuditLog.record`, which only queues: one worker thread bounds the fields (fields.py),
numbers and seals each record (chain.py), appends it, and fsyncs once per batch, in the order
the records were made. Nothing the disk does reaches a request: a full queue drops records and a
failed write loses one, and either is itself recorded (``records_lost``) as soon as writing
works again, so a gap is never silent.

One tenant cannot spend the others' history (issue 30, item 6). The log fails closed for the
tenant that loads it, before that tenant's code runs, rather than losing or deleting anyone's
records: :meth:`AuditLog.pressure` says why a tenant's executions must wait, and the audit gate
(gate.py) refuses them while it does. Three reasons: the tenant's records passed its bytes per
minute (usage.py); the queue is past its high-water mark and the tenant has the most records in
it (so the queue drains instead of reaching :data:`QUEUE_LIMIT`, where records are dropped: that
stays only as the last resort); the disk budget is full of history too young to delete and the
tenant holds the most of it (retention.py). Records already made are always queued: the
refusals themselves, sessions created and deleted, another tenant's executions.

The chain survives what a gateway lives through:

* Rotation: past ``max_bytes``, or a day after the file was started, the file becomes
  ``audit-<first seq>.jsonl``; the next record (``log_rotated``) starts the new ``audit.jsonl``
  and links to the rotated file's last record. Rotated files past their age are deleted, oldest
  first (retention.py: by age within a disk budget, never by count), and the ``log_rotated``
  record names them, with the bytes each tenant's records took in the rotated file. The head
  (last hash) of each rotated file is also written to the gateway's own log, an external anchor
  (see verify.py for what an anchor proves).
* Restart: :meth:`open` reads the end of the current file and continues its chain; the first
  record of every process is ``chain_resumed`` (``chain_started`` for a new log), saying whether
  the previous process closed the log cleanly.
* A damaged tail (a crash mid-write, a bad sector): the file is set aside as a rotated file
  untouched, and ``chain_resumed`` records where the damage starts, its size and SHA-256, linking
  to the last intact record; ``sandkernel audit verify`` accepts exactly that recorded damage.

Files are 0600 in a 0700 directory of ours (a looser mode is narrowed, a symlinked file or
another user's directory refused); every file operation is relative to the directory opened
once. One writer per directory: an exclusive ``flock`` on ``audit.lock``, or two gateways would
fork the chain.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from sandkernel.errors import ConfigError
from sandkernel.gateway.audit.chain import CURRENT_NAME, GENESIS, seal
from sandkernel.gateway.audit.fields import fit, prepare
from sandkernel.gateway.audit.files import (
    Tail,
    first_record,
    lock_directory,
    open_directory,
    open_file,
    read_tail,
    record_time,
    rotated_names,
    set_aside,
    utc_now,
)
from sandkernel.gateway.audit.retention import Retention
from sandkernel.gateway.audit.usage import (
    DISK_BUDGET,
    QUEUE_HIGH_WATER,
    TENANT_RATE,
    Pressure,
    TenantWindow,
    heaviest,
)

log = logging.getLogger(__name__)

# Records waiting for the worker; past it, record() drops (and counts) rather than grow memory.
QUEUE_LIMIT = 10_000
# From this share of QUEUE_LIMIT on, the tenants with the most queued records are refused new
# executions; what stays below QUEUE_LIMIT is room for the records of executions already running.
HIGH_WATER = 0.8
QUEUE_RETRY_SECONDS = 2  # a writer behind catches up in seconds (it writes in batches)
# A budget full of young history frees up as files age out: retry then, but ask again within an
# hour (another tenant's files may age out first, or the operator may raise the budget).
MIN_DISK_RETRY_SECONDS = 60
MAX_DISK_RETRY_SECONDS = 3600
ROTATE_SECONDS = 86_400  # a file is rotated a day after it was started, so files age out on time
HOUSEKEEPING_SECONDS = 60.0  # how often the worker looks at the file's age and the budget when idle
CLOSE_TIMEOUT = 30.0
_STOP = object()


def high_water() -> int:
    """Queued records from which the heaviest tenants are refused (read at the call, so a test
    that lowers QUEUE_LIMIT moves it too)."""
    return int(QUEUE_LIMIT * HIGH_WATER)


@dataclasses.dataclass(frozen=True)
class Head:
    """The last record written: its seq and hash (what the next record's ``prev`` will be)."""

    seq: int
    hash: str


class AuditLog:
    """The audit stream of one gateway. Build with :meth:`open`; :meth:`record` from the event
    loop (never blocks, never raises); :meth:`close` when the gateway stops."""

    def __init__(
        self,
        directory: Path,
        dir_fd: int,
        lock_fd: int,
        include_code: bool,
        max_bytes: int,
        retention: Retention,
        tenant_bytes_per_minute: int | None,
    ):
        self.directory = directory
        self.include_code = include_code
        self.max_bytes = max_bytes
        self.retention = retention
        self.tenant_bytes_per_minute = tenant_bytes_per_minute
        self.rates = TenantWindow()
        self._dir_fd = dir_fd
        self._lock_fd = lock_fd
        self._fd = -1
        self._size = 0
        self._first_seq = 0
        self._file_started = time.time()  # when the current file's first record was written
        self._next_housekeeping = 0.0
        self._head = Head(-1, GENESIS)
        self._cond = threading.Condition()
        self._items: collections.deque[Any] = collections.deque()
        self._queued = 0
        self._queued_by: dict[str, int] = {}  # queued records per tenant (under _cond)
        self._dropped = 0  # queue full (counted under _cond)
        self._failed = 0  # writes that failed (worker only)
        self._failure = ""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stopped: concurrent.futures.Future[None] = concurrent.futures.Future()

    # -- opening: where the chain stands ------------------------------------------------------
    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        include_code: bool = True,
        max_bytes: int = 64 << 20,
        keep_days: float | None = None,
        max_disk_bytes: int | None = None,
        tenant_bytes_per_minute: int | None = None,
    ) -> AuditLog:
        """Open (or create) the audit log in ``directory`` and write this process's first record.
        Blocking: call once at start-up. Raises ConfigError when the directory or its files
        cannot be used (another user's, a symlinked file, another gateway holding the lock, the
        first record not writable): an operator who asked for an audit log gets one or no gateway.

        ``keep_days``, ``max_disk_bytes`` (retention.py) and ``tenant_bytes_per_minute``
        (usage.py) default to no limit: the gateway passes its settings, where their defaults
        are; a tool or test that opens a log states the limits it wants."""
        if max_disk_bytes is not None and max_disk_bytes < 2 * max_bytes:
            raise ConfigError(
                f"the audit log's disk budget ({max_disk_bytes} bytes, --audit-max-mb) must hold at least two files "
                f"of --audit-max-bytes ({max_bytes}): the file being written and one rotated"
            )
        directory = Path(directory)
        dir_fd = open_directory(directory)
        try:
            lock_fd = lock_directory(dir_fd, directory)
        except BaseException:
            os.close(dir_fd)
            raise
        retention = Retention(keep_days, max_disk_bytes)
        audit = cls(directory, dir_fd, lock_fd, include_code, max_bytes, retention, tenant_bytes_per_minute)
        try:
            audit._resume()
        except BaseException:
            audit._close_files()
            raise
        audit._thread = threading.Thread(target=audit._run, name="sandkernel-audit", daemon=True)
        audit._thread.start()
        return audit

    def _resume(self) -> None:
        """Find the last intact record (current file, else the newest rotated one), set a damaged
        current file aside, and write ``chain_resumed`` (or ``chain_started``)."""
        fields: dict[str, Any] = {"pid": os.getpid()}
        tail = Tail(None, None)
        fd = open_file(self._dir_fd, CURRENT_NAME, create=False)
        if fd is not None and os.fstat(fd).st_size == 0:
            os.close(fd)
            os.unlink(CURRENT_NAME, dir_fd=self._dir_fd)  # created, never written: nothing to keep
            fd = None
        if fd is not None:
            tail = read_tail(fd, CURRENT_NAME)
            first = first_record(fd)
            if tail.damaged is None and tail.last is not None:
                self._fd, self._size = fd, os.fstat(fd).st_size
                self._first_seq = first["seq"] if first is not None else tail.last["seq"]
                self._file_started = record_time(first) or self._file_started
            else:  # keep the damaged file as it is, under a rotated name, and start a fresh one
                os.close(fd)
                seq = first["seq"] if first is not None else (tail.last or {}).get("seq")
                aside = set_aside(self._dir_fd, seq)
                if tail.damaged is not None:
                    tail.damaged["file"] = aside
        if tail.last is None:  # no chain in a current file: it goes on from the newest rotated one
            for name in rotated_names(self._dir_fd)[-1:]:
                rfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
                try:
                    found = read_tail(rfd, name)
                finally:
                    os.close(rfd)
                tail = Tail(found.last, tail.damaged or found.damaged)
        if tail.last is not None:
            self._head = Head(tail.last["seq"], tail.last["hash"])
            fields["clean_shutdown"] = tail.last["event"] == "log_closed"
        if tail.damaged is not None:
            fields["damaged_tail"] = tail.damaged
            log.warning("the audit log's tail was damaged; set aside and recorded", extra=dict(tail.damaged))
        if self._fd < 0:
            self._fd = self._create_current()
            self._first_seq = self._head.seq + 1
        self.retention.load(self._dir_fd, self._fd)
        event = "chain_resumed" if tail.last is not None else "chain_started"
        if not self._append(utc_now(), event, fields):
            raise ConfigError(f"cannot write the audit log in {self.directory}: {self._failure}")
        self._sync()
        # Before the first request, not at the worker's first batch: a budget already full of
        # young history refuses its heaviest holders from the start.
        self.retention.update_full(self._size)
        log.info("audit log %s at seq %d, head %s", self.directory / CURRENT_NAME, self._head.seq, self._head.hash)

    def _create_current(self) -> int:
        fd = open_file(self._dir_fd, CURRENT_NAME, create=True)
        assert fd is not None
        os.fsync(self._dir_fd)
        self._size = 0
        self._file_started = time.time()
        return fd

    # -- the event loop's side ----------------------------------------------------------------
    @property
    def head(self) -> Head:
        """The last record written so far (records still queued are not in it; see :meth:`flush`)."""
        return self._head

    def record(self, event: str, **fields: Any) -> None:
        """Queue one record: ``event`` plus ``fields`` (anything JSON-like; bounded and escaped by
        the worker). Never blocks on the disk and never raises; the time is taken now. Call from
        one thread (the event loop) for the records to keep the order of the calls."""
        item = (utc_now(), event, fields)
        tenant = fields.get("tenant")
        with self._cond:
            if self._closed:
                self._dropped += 1
                return
            if self._queued >= QUEUE_LIMIT:  # the last resort: the audit gate refuses long before
                self._dropped += 1
                return
            self._items.append(item)
            self._queued += 1
            if isinstance(tenant, str):
                self._queued_by[tenant] = self._queued_by.get(tenant, 0) + 1
            self._cond.notify()

    def pressure(self, tenant: str) -> Pressure | None:
        """Why ``tenant``'s executions must wait now (None: they need not). Cheap (the audit gate
        asks before every execution): the tenant's own rate first, then the queue, then the disk."""
        limit = self.tenant_bytes_per_minute
        if limit is not None:
            written = self.rates.total(tenant)
            if written > limit:
                return Pressure(TENANT_RATE, self.rates.seconds_until_within(tenant, limit), written, limit)
        with self._cond:
            queued = self._queued
            by_tenant = dict(self._queued_by) if queued >= high_water() else {}
        if tenant in heaviest(by_tenant):
            return Pressure(QUEUE_HIGH_WATER, QUEUE_RETRY_SECONDS, by_tenant[tenant], queued)
        retention = self.retention
        if retention.full and retention.max_disk_bytes is not None and tenant in retention.heaviest_holders():
            wait = retention.seconds_until_oldest_expires()
            retry = MAX_DISK_RETRY_SECONDS if wait is None else min(MAX_DISK_RETRY_SECONDS, wait)
            retry = max(MIN_DISK_RETRY_SECONDS, retry)
            return Pressure(DISK_BUDGET, retry, retention.holdings().get(tenant, 0), retention.max_disk_bytes)
        return None

    async def flush(self, timeout: float = CLOSE_TIMEOUT) -> Head | None:
        """Wait until every record queued so far is written and synced; the head then (None if
        the worker did not answer within ``timeout`` seconds)."""
        waiter: concurrent.futures.Future[Head] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                return self._head
            self._items.append(waiter)
            self._cond.notify()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(waiter), timeout)
        except asyncio.TimeoutError:
            return None

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Write what is queued and a last record (``log_closed``), sync, and let go of the files.
        Idempotent."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._items.append((utc_now(), "log_closed", {"pid": os.getpid()}))
                self._items.append(_STOP)
                self._cond.notify()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._stopped), timeout)
        except asyncio.TimeoutError:
            log.error("the audit log did not close within %s s", timeout)

    # -- the worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:  # never expected: say so loudly, and let close() return
            log.exception("the audit log's writer stopped")
        finally:
            self._finish()

    def _loop(self) -> None:
        stop = False
        self._housekeeping(force=True)
        while not stop:
            with self._cond:
                if not self._items:
                    self._cond.wait(HOUSEKEEPING_SECONDS)
                batch = list(self._items)
                self._items.clear()
                self._queued = 0
                self._queued_by.clear()
                dropped, self._dropped = self._dropped, 0
            waiters = []
            self._failed_or_dropped(dropped)
            for item in batch:
                if item is _STOP:
                    stop = True
                elif isinstance(item, concurrent.futures.Future):
                    waiters.append(item)
                else:
                    self._append(*item)
            if not stop:
                self._housekeeping()
            self._sync()
            for waiter in waiters:
                _settle(waiter, self._head)

    def _housekeeping(self, force: bool = False) -> None:
        """Rotate a file a day old; when the disk budget is reached, rotate at once if files past
        their age can make room (the rotation deletes them and says so), else mark the budget full.
        Every HOUSEKEEPING_SECONDS, or at once when the budget was just reached."""
        retention = self.retention
        reached = retention.over_budget(self._size) and not retention.full
        now = time.monotonic()
        if not (force or reached or now >= self._next_housekeeping):
            return
        self._next_housekeeping = now + HOUSEKEEPING_SECONDS
        if retention.full:  # the operator may have made room by hand
            retention.rescan(self._dir_fd)
        wall = time.time()
        aged = wall - self._file_started >= ROTATE_SECONDS
        if aged or (retention.over_budget(self._size) and retention.expired(self._dir_fd, wall)):
            self._rotate()
        retention.update_full(self._size)

    def _failed_or_dropped(self, dropped: int) -> None:
        """Record the records lost since the last batch, before anything else."""
        if not dropped and not self._failed:
            return
        fields: dict[str, Any] = {"dropped": dropped, "failed": self._failed}
        if self._failed:
            fields["error"] = self._failure
        failed = self._failed
        if self._append(utc_now(), "records_lost", fields):
            self._failed -= failed
        else:
            self._failed -= 1  # the note itself is not one of the records it counts
        log.error("audit records lost: %d dropped (queue full), %d failed writes", dropped, failed)

    def _append(self, time: str, event: str, fields: dict[str, Any]) -> bool:
        """Seal and write one record (rotating first when it would pass ``max_bytes``). False
        (the record counted as failed) when it could not be written; never raises."""
        try:
            body = fit({"seq": 0, "time": time, "event": event, **prepare(fields, self.include_code)})
            line, digest = self._seal(body)
            if self._size and self._size + len(line) > self.max_bytes and event != "log_rotated":
                self._rotate()
                line, digest = self._seal(body)
            self._write(line)
            tenant = fields.get("tenant")
            if isinstance(tenant, str):
                self.rates.add(tenant, len(line))
                self.retention.wrote(tenant, len(line))
        except Exception as err:  # the disk, or a value no bound foresaw: count it, go on
            self._failed += 1
            self._failure = f"{type(err).__name__}: {err}"
            if self._failed == 1 or self._failed % 1000 == 0:
                log.error("cannot write an audit record (%s)", self._failure, extra={"audit_event": event})
            return False
        self._size += len(line)
        self._head = Head(body["seq"], digest)
        return True

    def _seal(self, body: dict[str, Any]) -> tuple[bytes, str]:
        body["seq"] = self._head.seq + 1
        body["prev"] = self._head.hash
        return seal(body)

    def _write(self, line: bytes) -> None:
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            # a partial line must not stay: cut the file back to the last whole record
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise

    def _sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as err:
            log.error("cannot sync the audit log: %s", err)

    def _rotate(self) -> None:
        """Rename the current file after its first seq, delete rotated files past their age, open
        a fresh current file and start it with ``log_rotated``. A failure leaves the current
        file in use (over its size) rather than losing records."""
        previous = self._head
        try:
            os.fsync(self._fd)
            name = set_aside(self._dir_fd, self._first_seq)
        except OSError as err:
            log.error("cannot rotate the audit log: %s", err)
            self.max_bytes *= 2  # do not retry on every record
            self._file_started = time.time()  # nor every minute
            return
        try:
            new_fd = self._create_current()
        except (OSError, ConfigError) as err:  # keep writing to the renamed file
            log.error("cannot start a new audit file: %s", err)
            self.max_bytes *= 2
            self._file_started = time.time()
            return
        old_fd, self._fd = self._fd, new_fd
        os.close(old_fd)
        held = self.retention.rotated(name)
        removed = self.retention.expire(self._dir_fd)
        first_previous, self._first_seq = self._first_seq, previous.seq + 1
        log.info(
            "audit log rotated: %s holds seq %d..%d, head %s",
            name,
            first_previous,
            previous.seq,
            previous.hash,
            extra={"audit_head": previous.hash, "audit_seq": previous.seq},
        )
        self._append(
            utc_now(),
            "log_rotated",
            {"previous_file": name, "previous_first_seq": first_previous, "removed": removed, "tenant_bytes": held},
        )
        self.retention.update_full(self._size)

    def _finish(self) -> None:
        self._sync()
        log.info("audit log closed at seq %d, head %s", self._head.seq, self._head.hash)
        self._close_files()
        _settle(self._stopped, None)

    def _close_files(self) -> None:
        """Let go of the file, the lock (another process may open the log now) and the directory."""
        for fd in (self._fd, self._lock_fd, self._dir_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._lock_fd = self._dir_fd = -1


def _settle(future: concurrent.futures.Future[Any], value: Any) -> None:
    """Give a waiter its value unless it stopped waiting (a timed-out flush cancels it)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(value)
