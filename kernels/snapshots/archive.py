"""A session's files (/workspace and /tmp) as one tar, made and unpacked inside its sandbox.

Why inside: the files are the tenant's, so their names, links and contents are hostile. GNU tar
in the image (``/usr/bin/tar``, root-owned, read-only, named by absolute path so a planted
``/workspace/.local/bin/tar`` is never looked up) runs by ``docker exec`` AS THE SANDBOX USER,
never root. Packing, it can read only what the sandbox can read; unpacking, it can write only
where the sandbox can write anyway (the root fs is read-only, /etc and /opt are root's), it keeps
no owner from the archive (every file belongs to the unpacking sandbox's own uid), and its own
guards apply: leading ``/`` stripped, ``..`` members refused, symlinks whose target is absolute
or climbs (``/etc``, ``../tmp``) created only after every file, so nothing is written through them.
Members are named relative to ``/`` (``-C /``) and the unpack is limited to ``workspace`` and
``tmp``. The host only moves bytes: it streams tar's stdout into a file it created (O_EXCL,
O_NOFOLLOW, 0600) and hashes them on the way, and streams that file back into tar's stdin through
the exec's attach socket. It never opens, lists or parses the archive (a compromised tar in the
sandbox could emit anything; that is the sandbox's own data and nobody else's).

The kernel's own files in /tmp (:data:`KERNEL_TMP_FILES`) are never captured and never removed or
overwritten on restore: they belong to the kernel running now, not to the session being restored.

Both runtimes take stdin through the attach socket (measured under runc and gVisor 20221219, see
tests/test_snapshot_archive.py). All Docker work runs in a worker thread; each transfer is bounded
by a deadline and stops when the awaiting task is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import shlex
import socket
import threading
from pathlib import Path
from typing import Any

import docker.errors

from sandkernel.errors import SnapshotError, SnapshotQuotaError, SnapshotRejectedError
from sandkernel.kernels.sandbox.container import SandboxContainer
from sandkernel.kernels.sandbox.exec_stream import (
    CHUNK,
    SANDBOX_SHELL,
    Deadline,
    ExecSocket,
    ExecStreamError,
    exit_code,
    frames,
    kill_exec,
    send_all,
    start_exec,
    start_held,
)
from sandkernel.kernels.snapshots.quota import Allowance

log = logging.getLogger(__name__)

TAR = "/usr/bin/tar"
FIND = "/usr/bin/find"
RM = "/bin/rm"
CHMOD = "/bin/chmod"
SORT = "/usr/bin/sort"
SHA256SUM = "/usr/bin/sha256sum"
# What a snapshot holds, as member names relative to / (tar runs with -C /).
MEMBERS = ("workspace", "tmp")
# /tmp entries of the kernel running now: launch-kernel's files (it rewrites them at each start)
# and the Dockerfile's IPYTHONDIR (the open history database), JUPYTER_RUNTIME_DIR and
# MPLCONFIGDIR. tests/test_snapshot_archive.py checks that this list covers both files.
KERNEL_TMP_FILES: tuple[str, ...] = (
    "/tmp/kernel.json",
    "/tmp/kernel.log",
    "/tmp/kernel.pid",
    "/tmp/egress-relay.log",
    "/tmp/.ipython",
    "/tmp/.jupyter-runtime",
    "/tmp/.matplotlib",
    "/tmp/.sandkernel",  # a savable sandbox's supervisor and kernel sockets (kernel_supervisor.py)
)
DEFAULT_TIMEOUT = 600.0  # seconds for one capture or restore, whatever its size
STDERR_KEPT = 2000  # characters of tar's stderr carried in an error message
# tar exits 1 when a file changed, shrank or vanished while it was read (the kernel may be
# writing): the archive is still whole. 2 is a real failure (unreadable file, disk full...).
TAR_CHANGED = 1
CLEANUP_FAILED = 90  # exit code of the restore script when emptying the old files failed
_SHA256 = re.compile(r"[0-9a-f]{64}")
PACKING, UNPACKING = "packing the session's files", "unpacking the snapshot"  # what a stream error names


@dataclasses.dataclass(frozen=True)
class ArchivePart:
    """One archive of a snapshot: its size in bytes and its SHA-256 (hex), checked before use."""

    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: Any) -> ArchivePart:
        """Parse a manifest's record; ValueError on anything but ``{"bytes": int >= 0, "sha256": hex}``."""
        if not isinstance(data, dict) or set(data) != {"bytes", "sha256"}:
            raise ValueError(f"an archive part is {{'bytes', 'sha256'}}, not {str(data)[:100]!r}")
        size, digest = data["bytes"], data["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"an archive part's bytes must be a whole number >= 0, not {str(size)[:40]!r}")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ValueError(f"an archive part's sha256 must be 64 lowercase hex digits, not {str(digest)[:80]!r}")
        return cls(bytes=size, sha256=digest)


# tar's record when packing, in 512-byte blocks: 256 KiB. Each tar read and write is a syscall,
# dear under gVisor: packing 200 MB there took 1.1-1.2 s at 64 KiB, 0.65-0.8 s at 256 KiB and
# 0.65 s at 1 MiB; tar's default of 10 KiB was slower still. Not larger: every archive is padded
# to a whole record, which a cell checkpoint of a small workspace pays against the quota.
RECORD_BLOCKS = 512
# ... and when unpacking: 1 MiB. Reading whole records (--read-full-records) of any multiple of the
# packing record takes a final short one at the end of the stream; under gVisor 200 MB unpacked in
# 0.63-0.9 s at 64 KiB and 0.15 s at 1 MiB from a file, 1.2 s and 0.6 s from a pipe (no change
# under runc).
UNPACK_RECORD_BLOCKS = 2048


def _selection() -> list[str]:
    """tar options that leave the kernel's files out, matched from the member name's start only
    (``--anchored``: ``tmp/kernel.pid`` never drops ``workspace/tmp/kernel.pid``)."""
    return ["--anchored", "--no-wildcards", *(f"--exclude={path.lstrip('/')}" for path in KERNEL_TMP_FILES)]


def capture_argv() -> list[str]:
    """The packing command: GNU tar of /workspace and /tmp to stdout, in RECORD_BLOCKS records,
    holes kept."""
    return [
        TAR,
        "--create",
        "--file=-",
        "--directory=/",
        f"--blocking-factor={RECORD_BLOCKS}",
        "--sparse",
        "--warning=no-file-changed",
        "--warning=no-file-removed",
        "--warning=no-file-shrank",
        "--warning=no-file-ignored",  # sockets: not archivable, and nothing to restore
        *_selection(),
        "--",
        *MEMBERS,
    ]


def restore_argv() -> list[str]:
    """Empty /workspace and /tmp (sparing the kernel's files), then unpack stdin there.

    Directories the tenant made unwritable (chmod 500) are opened up first so ``rm -rf`` can
    empty them: the sandbox user owns them, so it may. ``--preserve-permissions`` keeps modes
    (tar keeps mtimes anyway); ``--no-same-owner``: every file is the unpacking sandbox's. Only
    members under ``workspace/`` and ``tmp/`` are unpacked (the member arguments)."""
    spared = " ".join(f"-path {shlex.quote(p)} -prune -o" for p in KERNEL_TMP_FILES)
    unpack = [
        TAR,
        "--extract",
        "--file=-",
        "--directory=/",
        # Whole records (a pipe returns short reads), larger than capture_argv's (see above).
        f"--blocking-factor={UNPACK_RECORD_BLOCKS}",
        "--read-full-records",
        "--preserve-permissions",
        "--no-same-owner",
        # /tmp (root's, 1777) and /workspace themselves are not the archive's to change: their
        # own entries are left out, exactly (no recursion while this exclude is read), their
        # contents are not.
        "--no-recursion",
        "--anchored",
        "--no-wildcards",
        *(f"--exclude={member}" for member in MEMBERS),
        "--recursion",
        *_selection(),
        "--",
        *MEMBERS,
    ]
    script = (
        f"{FIND} /workspace /tmp -mindepth 1 {spared} -type d ! -perm -u=rwx -exec {CHMOD} u+rwx {{}} + ; "
        f"{FIND} /workspace -mindepth 1 -maxdepth 1 -exec {RM} -rf -- {{}} + || exit {CLEANUP_FAILED}; "
        f"{FIND} /tmp -mindepth 1 -maxdepth 1 {spared} -exec {RM} -rf -- {{}} + || exit {CLEANUP_FAILED}; "
        f"exec {shlex.join(unpack)}"
    )
    return [SANDBOX_SHELL, "-c", script]


def fingerprint_argv() -> list[str]:
    """A SHA-256 of what /workspace and /tmp hold (kind, mode, size, mtime and name of every
    entry but the kernel's files): equal before and after some work means the work changed no
    file. A ``find`` that fails makes a fingerprint that matches nothing."""
    spared = " ".join(f"-path {shlex.quote(p)} -prune -o" for p in KERNEL_TMP_FILES)
    listing = f"{FIND} /workspace /tmp -mindepth 1 {spared} -printf '%y %m %s %T@ %p\\0'"
    return [SANDBOX_SHELL, "-c", f"{{ {listing} 2>/dev/null || echo find-failed-$$; }} | {SORT} -z | {SHA256SUM}"]


async def files_fingerprint(container: SandboxContainer, timeout: float = 120.0) -> str | None:
    """:func:`fingerprint_argv`'s digest, run as the sandbox user; None when it could not be had."""
    status, out = await container.run_as_sandbox(fingerprint_argv(), timeout)
    digest = out.split()[0] if out.split() else ""
    return digest if status == 0 and _SHA256.fullmatch(digest) else None


async def capture_files(
    container: SandboxContainer,
    dest: Path,
    max_bytes: int,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    allowance: Allowance | None = None,
) -> ArchivePart:
    """Pack the sandbox's /workspace and /tmp into ``dest`` (a new host file, 0600).

    Called by the snapshot code (pause, fork, cell checkpoints) with a path of its own choosing.
    Returns the archive's size and SHA-256, computed while writing. Raises
    :class:`SnapshotQuotaError` past ``max_bytes`` or when ``allowance`` (the tenant's quota,
    shared with its other captures under way) has no room for the next piece,
    :class:`SnapshotError` when tar fails (its
    stderr in the message), the container is gone, ``dest`` exists, or ``timeout`` seconds pass.
    On any failure ``dest`` is removed: no partial archive is left."""
    deadline = Deadline(timeout)

    def work() -> ArchivePart:
        fd = _create(dest)
        kept = False
        try:
            with os.fdopen(fd, "wb") as out:
                digest, size, stderr = hashlib.sha256(), 0, bytearray()
                api = container.engine.client.api
                exec_id, sock, output = start_held(
                    api, container.id, container.user, capture_argv(), deadline, PACKING, workdir="/"
                )
                finished = False
                try:
                    for stream, data in output:
                        if stream == 1:
                            size += len(data)
                            if size > max_bytes:
                                raise SnapshotQuotaError(
                                    f"the session's files (/workspace and /tmp, packed) passed {size} bytes, over "
                                    f"the snapshot size limit of {max_bytes} bytes: remove files or raise the limit"
                                )
                            if allowance is not None and not allowance.take(len(data)):
                                raise SnapshotQuotaError(
                                    f"the token's snapshots reached its quota of {allowance.quota} bytes while this "
                                    f"one was written ({size} bytes so far; snapshots being written count too): "
                                    "delete paused sessions it no longer needs, or remove files"
                                )
                            digest.update(data)
                            out.write(data)
                        else:
                            stderr = _keep_tail(stderr, data)
                    code = output.finish(api, container.id, exec_id, deadline)
                    finished = True
                finally:
                    sock.close()
                    if not finished:
                        kill_exec(api, container.id, exec_id)
                if code not in (0, TAR_CHANGED):
                    raise SnapshotError(
                        f"packing the session's files failed in the sandbox (tar exit {code}): {_text(stderr)}"
                    )
                if code == TAR_CHANGED:
                    log.info("files changed while packed", extra={"container": container.id[:12]})
                out.flush()
                os.fsync(out.fileno())
            kept = True
            return ArchivePart(bytes=size, sha256=digest.hexdigest())
        finally:
            if not kept:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(dest)

    return await _in_thread(container, work, deadline.stop, "pack the session's files")


async def restore_files(
    container: SandboxContainer, source: Path, expected: ArchivePart, *, timeout: float | None = DEFAULT_TIMEOUT
) -> None:
    """Replace the sandbox's /workspace and /tmp (but the kernel's own files) with ``source``.

    Called on resume, fork and rewind, with the archive :func:`capture_files` made and the part
    the (signed) manifest recorded. ``source`` is hashed first: a size or SHA-256 that differs
    raises :class:`SnapshotRejectedError` and nothing in the sandbox is touched. Then, inside the
    sandbox as its user, the old files are removed and tar unpacks the archive from stdin.
    Raises :class:`SnapshotError` when that fails (tar's stderr in the message); the sandbox's
    files are then partly restored and the caller must not hand the session out as restored."""
    deadline = Deadline(timeout)

    def work() -> None:
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise SnapshotRejectedError(f"the snapshot's archive cannot be read ({err.strerror})") from err
        with os.fdopen(fd, "rb") as archive:
            _verify(archive, expected)
            archive.seek(0)
            api = container.engine.client.api
            exec_id = api.exec_create(container.id, restore_argv(), user=container.user, workdir="/", stdin=True)["Id"]
            sock = start_exec(api, container.id, exec_id, deadline, UNPACKING)
            try:
                output = _Drain(sock, deadline)
                try:
                    _send(sock, archive, deadline)
                except BaseException:
                    sock.shutdown(socket.SHUT_RDWR)  # ends the drain's read at once
                    output.join()
                    raise
                output.finish()
            finally:
                sock.close()
        code = exit_code(api, exec_id, deadline, UNPACKING)
        if code == CLEANUP_FAILED:
            raise SnapshotError(f"emptying the session's files before the restore failed: {_text(output.stderr)}")
        if code != 0:
            raise SnapshotError(
                f"unpacking the snapshot in the sandbox failed (tar exit {code}): {_text(output.stderr)}"
            )

    await _in_thread(container, work, deadline.stop, "restore the session's files")


# -- the host side of the transfer: bytes only ----------------------------------------------------


def _create(dest: Path) -> int:
    try:
        return os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise SnapshotError(f"cannot create the snapshot's archive file ({err.strerror})") from err


def _verify(archive: Any, expected: ArchivePart) -> None:
    """Hash the whole file; SnapshotRejectedError unless size and SHA-256 are the manifest's."""
    size = os.fstat(archive.fileno()).st_size
    if size != expected.bytes:
        raise SnapshotRejectedError(
            f"the snapshot's archive is {size} bytes, its manifest says {expected.bytes}: it was truncated or "
            "altered and is not restored"
        )
    digest = hashlib.sha256()
    while chunk := archive.read(CHUNK):
        digest.update(chunk)
    if digest.hexdigest() != expected.sha256:
        raise SnapshotRejectedError(
            "the snapshot's archive does not match the SHA-256 its manifest recorded: "
            "it was altered and is not restored"
        )


def _send(raw: ExecSocket, archive: Any, deadline: Deadline) -> None:
    """Stream the archive into the exec's stdin, then close our writing half (tar sees EOF).
    A sandbox that stopped reading (its script failed, tar died) is not an error here: the exit
    code and stderr say what happened."""
    try:
        while chunk := archive.read(CHUNK):
            send_all(raw, chunk, deadline, UNPACKING)
        raw.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError) as err:
        log.info("the sandbox stopped reading the archive: %s", err)


class _Drain(threading.Thread):
    """Reads the exec's output while the archive is sent (tar's error messages must not fill the
    socket and stall the upload); keeps the tail of stderr for the error message."""

    def __init__(self, raw: ExecSocket, deadline: Deadline) -> None:
        super().__init__(name="snapshot-restore-output", daemon=True)
        self.raw, self.deadline = raw, deadline
        self.stderr = bytearray()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for _, data in frames(self.raw, self.deadline, UNPACKING):
                self.stderr = _keep_tail(self.stderr, data)
        except (ExecStreamError, OSError) as err:
            self.error = err

    def finish(self) -> None:
        """Wait for the output to end (bounded by the idle timeout per read and the deadline)."""
        self.join()
        if self.error is not None:
            raise SnapshotError(f"reading the sandbox's output failed: {self.error}") from self.error


def _keep_tail(buf: bytearray, data: bytes) -> bytearray:
    buf += data
    return buf[-4 * STDERR_KEPT :] if len(buf) > 8 * STDERR_KEPT else buf


def _text(stderr: bytes | bytearray) -> str:
    text = bytes(stderr).decode(errors="replace").strip()
    return (text[-STDERR_KEPT:] if len(text) > STDERR_KEPT else text) or "(no message)"


async def _in_thread(container: SandboxContainer, work: Any, stop: threading.Event, what: str) -> Any:
    """Run ``work`` in a worker thread (Docker connection errors translated by the engine); a
    cancelled caller stops the transfer at its next chunk rather than leaving it running."""
    try:
        async with container.init_watch.during():  # a tar the sandbox stopped before it ran is killed
            return await container.engine.run(work)
    except asyncio.CancelledError:
        stop.set()
        raise
    except docker.errors.APIError as err:
        raise SnapshotError(f"cannot {what}: the session's container is not available ({err.explanation})") from err
    except ExecStreamError as err:
        raise SnapshotError(f"cannot {what}: {err}") from err
