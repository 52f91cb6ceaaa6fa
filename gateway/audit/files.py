"""The audit log's directory on disk: opened safely, locked, and read back to find where the
chain stands (log.py writes; this module is what it needs of the files themselves).

Every operation is relative to the directory opened once (``O_DIRECTORY``), files are opened
``O_NOFOLLOW`` and checked to be regular files of this user, so nothing planted in the directory
is written through. The directory's own path may hold symlinks: that is the operator's
configuration (an audit disk mounted elsewhere), resolved that once.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from sandkernel.errors import ConfigError
from sandkernel.gateway.audit.chain import CURRENT_NAME, BrokenRecord, rotated_name, rotated_seq, unseal
from sandkernel.gateway.audit.fields import MAX_RECORD_BYTES
from sandkernel.pid_lock import LockHeldError, take_pid_lock

log = logging.getLogger(__name__)

LOCK_NAME = "audit.lock"
# Records written before issue 30 were bounded at 1 MiB, not MAX_RECORD_BYTES: a log carried over
# from then must still be resumed from its last record, not set aside as damaged.
EARLIER_MAX_RECORD_BYTES = 1024 * 1024
# Bytes read from a file's end (or start) to find its last (first) intact record.
TAIL_WINDOW = 2 * max(MAX_RECORD_BYTES, EARLIER_MAX_RECORD_BYTES) + 4096
_READ_CHUNK = 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


def utc_now() -> str:
    """The time a record carries: ISO 8601 UTC, microseconds."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def record_time(record: dict[str, Any] | None) -> float | None:
    """A record's ``time`` as a POSIX timestamp (None: no record, or no readable time)."""
    try:
        return dt.datetime.fromisoformat(str((record or {})["time"]).replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError):
        return None


@dataclasses.dataclass
class Tail:
    """What the end of a file holds: its last intact record (None: none found), and anything
    after that record (the damaged tail)."""

    last: dict[str, Any] | None
    damaged: dict[str, Any] | None


def read_tail(fd: int, name: str) -> Tail:
    size = os.fstat(fd).st_size
    start = max(0, size - TAIL_WINDOW)
    data = os.pread(fd, size - start, start)
    end = data.rfind(b"\n")
    while end >= 0:
        begin = data.rfind(b"\n", 0, end) + 1
        if begin == 0 and start > 0:
            break  # the window starts inside this line
        try:
            record = unseal(data[begin:end])
        except BrokenRecord:
            end = begin - 1
            continue
        good = start + end + 1
        return Tail(record, damage(name, good, data[end + 1 :]) if good < size else None)
    if start == 0:
        return Tail(None, damage(name, 0, data) if data else None)
    return Tail(None, {"file": name, "offset": None, "bytes": size, "note": "no intact record near the end"})


def damage(name: str, offset: int, rest: bytes) -> dict[str, Any]:
    """How a damaged tail is recorded: enough for verify to check that this, and only this, is
    what was set aside."""
    return {"file": name, "offset": offset, "bytes": len(rest), "sha256": hashlib.sha256(rest).hexdigest()}


def open_directory(directory: Path) -> int:
    """The directory, created 0700 or narrowed to 0700, opened once; ConfigError if it is not a
    directory of ours."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as err:
        raise ConfigError(f"cannot use the audit directory {directory}: {err}") from err
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"the audit directory {directory} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o077:
        log.warning("narrowing the audit directory %s to mode 0700 (was %o)", directory, st.st_mode & 0o777)
        os.fchmod(fd, 0o700)
    return fd


def lock_directory(dir_fd: int, directory: Path) -> int:
    """An exclusive flock on ``audit.lock`` with this pid in it (held until the log closes);
    ConfigError naming the holder when another process writes this directory."""
    try:
        return take_pid_lock(LOCK_NAME, dir_fd)
    except LockHeldError as held:
        raise ConfigError(
            f"the audit log in {directory} is written by another process (pid {held.holder}): one gateway per "
            "audit directory (two writers would fork the chain). Give this gateway another --audit-dir"
        ) from None


def open_file(dir_fd: int, name: str, create: bool) -> int | None:
    """``name`` opened for appending (None when absent and not ``create``); a regular file of
    ours narrowed to 0600, else ConfigError."""
    flags = _FILE_FLAGS | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symlink planted where the log goes
        raise ConfigError(f"cannot open the audit file {name}: {err}") from err
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ConfigError(f"the audit file {name} is not a regular file of this user")
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def first_record(fd: int) -> dict[str, Any] | None:
    """A file's first record (None: not a readable record). Reads a record's worth, and the
    whole window only when the first line is longer."""
    for size in (MAX_RECORD_BYTES, TAIL_WINDOW):
        head = os.pread(fd, size, 0)
        end = head.find(b"\n")
        if end >= 0 or len(head) < size:
            break
    try:
        return unseal(head[:end]) if end >= 0 else None
    except BrokenRecord:
        return None


def first_seq(fd: int) -> int | None:
    """The seq of a file's first record (None: not a readable record)."""
    record = first_record(fd)
    return None if record is None else record["seq"]


def tenant_bytes(fd: int) -> dict[str, int]:
    """Bytes of a file's lines per tenant they name (lines naming none, or unreadable, are not
    counted). Reads the whole file: once, when a gateway resumes its current file."""
    counts: dict[str, int] = {}
    offset, rest = 0, b""
    while chunk := os.pread(fd, _READ_CHUNK, offset):
        offset += len(chunk)
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            try:
                tenant = json.loads(line).get("tenant")
            except (ValueError, AttributeError):
                continue
            if isinstance(tenant, str):
                counts[tenant] = counts.get(tenant, 0) + len(line) + 1
    return counts


def read_first_record(dir_fd: int, name: str) -> dict[str, Any] | None:
    """The first record of the file ``name`` (None: gone, or not a readable record)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return first_record(fd)
    finally:
        os.close(fd)


def stat_file(dir_fd: int, name: str) -> os.stat_result | None:
    """``name``'s stat, not following a link (None: gone)."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def stored_bytes(dir_fd: int) -> int:
    """Bytes of every file in the directory but the current one (rotated, set aside, the lock):
    what the disk budget counts besides the file being written."""
    total = 0
    for name in os.listdir(dir_fd):
        if name != CURRENT_NAME and (st := stat_file(dir_fd, name)) is not None and stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def set_aside(dir_fd: int, seq: int | None) -> str:
    """Rename the current file to its rotated name (``seq``: its first record's), or to an
    ``audit-unreadable-<time>`` name when no seq could be read; the new name. Nothing is deleted
    or rewritten: a damaged file is evidence."""
    if seq is None:
        name = f"audit-unreadable-{utc_now().replace(':', '')}.jsonl"
    else:
        name = next(rotated_name(seq, i) for i in range(1000) if not _exists(dir_fd, rotated_name(seq, i)))
    os.rename(CURRENT_NAME, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)
    return name


def _exists(dir_fd: int, name: str) -> bool:
    return stat_file(dir_fd, name) is not None


def rotated_names(dir_fd: int) -> list[str]:
    """Rotated files, oldest first."""
    names = [(seq, n) for n in os.listdir(dir_fd) if (seq := rotated_seq(n)) is not None]
    return [n for _, n in sorted(names)]
