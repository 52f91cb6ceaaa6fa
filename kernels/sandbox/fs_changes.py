"""Did anything change on a workspace's filesystem since we last looked? (fanotify, as a flag)

Per-cell accounting (kernels/execution/accounting.py) compares snapshots of the workspace
(workspace_scan.py). A walk costs a thread hop and a stat per entry, and most cells write
nothing. Each disk workspace is its own ext4 filesystem, loop-mounted on the host
(workspace_disk.py), so a fanotify mark on that whole filesystem (``FAN_MARK_FILESYSTEM``) sees
every change to it, whoever makes it: the sandbox's processes under runc, gVisor's gofer or
Sentry under runsc (both write the same host files), the files API. :meth:`ChangeWatch.changed`
drains the queue without blocking (a few microseconds) and says whether it held anything.

The events are a flag only: of each, only the fixed header is read (the process that caused
it, so the host's own walks and hashing do not count; an overflow), never the file it names,
and no path is ever resolved (the sandbox names those files). ``FAN_REPORT_FID`` events hold
no reference to the files or the mount (the classic mode would pin open files and make the
unmount fail); a queue that overflows (16384 events by default, about 1 MiB of kernel memory)
delivers one more event, which reads as "changed" like any other.

Opens count as changes (``FAN_OPEN``): a store through a shared memory mapping is no system
call and makes no event, but the mapping needs an open file, so a cell that maps a file and
writes through it (``numpy.memmap(..., mode="r+")``) is seen by its open (checked under runc
and runsc). A cell that only reads workspace files is therefore walked too. What no event
shows: stores in a later cell through a mapping an earlier cell made and kept. A snapshot
missed those as well (checked here: neither the size nor the mtime moved).

Needs CAP_SYS_ADMIN (filesystem marks) and Linux >= 5.1 (``FAN_REPORT_FID``). Anything
refused raises :class:`Unavailable` with the reason: the caller then walks every cell.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from pathlib import Path

# <linux/fanotify.h>
FAN_MODIFY = 0x00000002
FAN_ATTRIB = 0x00000004
FAN_CLOSE_WRITE = 0x00000008
FAN_MOVED_FROM = 0x00000040
FAN_MOVED_TO = 0x00000080
FAN_CREATE = 0x00000100
FAN_DELETE = 0x00000200
FAN_DELETE_SELF = 0x00000400
FAN_MOVE_SELF = 0x00000800
FAN_ONDIR = 0x40000000
FAN_CLOEXEC = 0x00000001
FAN_NONBLOCK = 0x00000002
FAN_CLASS_NOTIF = 0x00000000
FAN_REPORT_FID = 0x00000200
FAN_MARK_ADD = 0x00000001
FAN_MARK_FILESYSTEM = 0x00000100

FAN_OPEN = 0x00000020
FAN_Q_OVERFLOW = 0x00004000
FANOTIFY_METADATA_VERSION = 3

# Everything that changes what a snapshot records (names, sizes, times, inodes, kinds), for
# files and directories, and opens (see the module docstring: memory-mapped writes).
MASK = (
    FAN_OPEN
    | FAN_MODIFY
    | FAN_ATTRIB
    | FAN_CLOSE_WRITE
    | FAN_MOVED_FROM
    | FAN_MOVED_TO
    | FAN_CREATE
    | FAN_DELETE
    | FAN_DELETE_SELF
    | FAN_MOVE_SELF
    | FAN_ONDIR
)
AT_FDCWD = -100
INIT_FLAGS = FAN_CLASS_NOTIF | FAN_REPORT_FID | FAN_NONBLOCK | FAN_CLOEXEC
_READ_SIZE = 64 * 1024
# struct fanotify_event_metadata: event_len, vers, reserved, metadata_len, mask, fd, pid.
_METADATA = struct.Struct("=IBBHQii")

_libc: ctypes.CDLL | None = None


class Unavailable(Exception):
    """fanotify cannot watch this workspace (the message says why, for a note)."""


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError as err:
            raise Unavailable(f"the C library cannot be loaded ({err})") from None
        if not hasattr(lib, "fanotify_init") or not hasattr(lib, "fanotify_mark"):
            raise Unavailable("this C library has no fanotify")
        lib.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        lib.fanotify_init.restype = ctypes.c_int
        lib.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        lib.fanotify_mark.restype = ctypes.c_int
        _libc = lib
    return _libc


class ChangeWatch:
    """A fanotify group marking the whole filesystem mounted at ``mount`` (its root must be a
    mount point: marking a plain directory would watch the filesystem that holds it, the
    host's). :meth:`close` releases it; the watch also ends by itself when that filesystem is
    unmounted, which :meth:`changed` notices (the mount point's device is checked each time)."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self._fd: int | None = None
        try:
            st, parent = os.stat(mount), os.stat(mount.parent)
        except OSError as err:
            raise Unavailable(f"the workspace mount cannot be read ({err.strerror})") from None
        if st.st_dev == parent.st_dev:
            raise Unavailable("the workspace is not a filesystem of its own")
        self._dev = st.st_dev
        self._mount = os.fsencode(mount)  # stat'ed at every check: no pathlib on that path
        lib = _lib()
        fd = lib.fanotify_init(INIT_FLAGS, os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            raise Unavailable(f"fanotify_init refused: {_reason(ctypes.get_errno())}")
        if lib.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, MASK, AT_FDCWD, self._mount) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise Unavailable(f"fanotify_mark refused: {_reason(err)}")
        self._fd = fd
        try:
            remounted = os.stat(self._mount).st_dev != self._dev  # then the mark may be on the old filesystem
        except OSError:
            remounted = True
        if remounted:
            self.close()
            raise Unavailable("the workspace was remounted while it was being watched")

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int | None:
        return self._fd

    def changed(self) -> bool:
        """Whether anything changed since the last call (or since the mark was made): drains
        the queue without blocking. Raises :class:`Unavailable` once the watch cannot answer
        (closed, or the filesystem at the mount point is not the one marked any more)."""
        if self._fd is None:
            raise Unavailable("the watch is closed")
        seen, own = False, os.getpid()
        while True:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                break
            if not data:
                break
            seen = seen or _caused_elsewhere(data, own)
        try:
            dev = os.stat(self._mount).st_dev
        except OSError as err:
            raise Unavailable(f"the workspace mount cannot be read ({err.strerror})") from None
        if dev != self._dev:
            raise Unavailable("the workspace was unmounted or remounted")
        return seen

    def close(self) -> None:
        """Release the fanotify group (its mark goes with it); safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _caused_elsewhere(data: bytes, own: int) -> bool:
    """Whether any event in ``data`` (whole events, as one read returns them) was caused by a
    process other than ``own`` (this one: the scan's opens), or is an overflow or something
    this module cannot read (both count as changes)."""
    offset, end = 0, len(data)
    while offset < end:
        if end - offset < _METADATA.size:
            return True
        length, version, _, _, mask, _, pid = _METADATA.unpack_from(data, offset)
        if version != FANOTIFY_METADATA_VERSION or length < _METADATA.size or mask & FAN_Q_OVERFLOW or pid != own:
            return True
        offset += length
    return False


def _reason(err: int) -> str:
    name = errno.errorcode.get(err, str(err))
    if err == errno.EPERM:
        return f"{name}: watching a filesystem needs CAP_SYS_ADMIN"
    if err in (errno.EINVAL, errno.ENOSYS):
        return f"{name}: this kernel lacks fanotify with file ids (Linux >= 5.1)"
    if err in (errno.ENODEV, errno.EOPNOTSUPP, errno.EXDEV):
        return f"{name}: this filesystem cannot report file ids"
    return f"{name}: {os.strerror(err)}"
