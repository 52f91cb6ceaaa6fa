"""Sparse files (a workspace disk's image): walk, copy and hash only the parts that hold data.

A workspace image is as large as the session's ``workspace_mb`` (1 GiB by default) but holds
blocks only where the sandbox wrote. Reading it whole would hash and copy every hole as zeros;
``SEEK_DATA`` / ``SEEK_HOLE`` name the data segments, ``copy_file_range`` copies them inside the
kernel (read and write across filesystems, where it cannot), and the holes stay holes in the copy.

The digest covers the file's size and each data segment's offset, length and bytes, so it
depends on where the holes are as well as on the data: a copy made by :func:`copy_sparse` on
the same kind of filesystem has the digest of its source. A filesystem that places holes
differently only makes a digest differ (a refused snapshot, never an accepted altered one).

Every function blocks on disk: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from sandkernel.kernels.sandbox.uncached_io import CHUNK as UNCACHED_CHUNK
from sandkernel.kernels.sandbox.uncached_io import go_uncached

CHUNK = 1024 * 1024
T = TypeVar("T")
SEGMENT_HEADER = struct.Struct(">QQ")  # offset, length: what each hashed segment starts with


def data_segments(fd: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each data segment of the open file ``fd``, in order. A filesystem
    without SEEK_DATA reports the whole file as one segment."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:  # no data after offset: the rest is a hole
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end - start
        offset = end


def allocated(st: os.stat_result) -> int:
    """What a file takes on disk: its blocks, never more than its size (a dense file's last
    block counts as the bytes it holds)."""
    return min(st.st_size, st.st_blocks * 512)


def allocated_bytes(fd: int) -> int:
    """:func:`allocated` of the open file ``fd``."""
    return allocated(os.fstat(fd))


def sparse_digest(fd: int) -> str:
    """SHA-256 (hex) of the file's size and its data segments (see the module docstring)."""
    digest = _digest_of_size(os.fstat(fd).st_size)
    for start, length in data_segments(fd):
        digest.update(SEGMENT_HEADER.pack(start, length))
        done = 0
        while done < length:
            chunk = os.pread(fd, min(CHUNK, length - done), start + done)
            if not chunk:
                raise OSError(errno.EIO, "the file shrank while it was hashed")
            digest.update(chunk)
            done += len(chunk)
    return digest.hexdigest()


def _digest_of_size(size: int) -> hashlib._Hash:
    """A digest that has taken in the file's size (what every sparse digest starts with)."""
    return hashlib.sha256(b"sparse-file-v1\0%d\0" % size)


def copy_to_new_file(source: Path, target: Path, *, durable: bool = False) -> None:
    """Copy the file ``source`` to the new path ``target`` (0600, never through a link, never
    over an existing file), holes kept; ``durable``: on disk before returning. On failure
    ``target`` is removed."""

    def copy(source_fd: int, target_fd: int) -> None:
        copy_sparse(source_fd, target_fd)
        if durable:
            os.fsync(target_fd)

    _into_new_file(source, target, copy)


def _into_new_file(source: Path, target: Path, copy: Callable[[int, int], T]) -> T:
    """``copy(source_fd, target_fd)`` from the file ``source`` into the new file ``target`` (0600,
    never through a link, never over an existing file); ``target`` is removed if it fails."""
    source_fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        target_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            return copy(source_fd, target_fd)
        except BaseException:
            os.unlink(target)
            raise
        finally:
            os.close(target_fd)
    finally:
        os.close(source_fd)


def copy_sparse(source_fd: int, target_fd: int) -> None:
    """Copy the open file ``source_fd`` into the empty ``target_fd``: the same size, data where
    the source has data, holes elsewhere."""
    size = os.fstat(source_fd).st_size
    os.ftruncate(target_fd, size)
    in_kernel = True
    for start, length in data_segments(source_fd):
        done = 0
        while done < length:
            offset, wanted = start + done, min(CHUNK * 64, length - done)
            if in_kernel:
                try:
                    copied = os.copy_file_range(source_fd, target_fd, wanted, offset, offset)
                except OSError as err:  # another filesystem (EXDEV) or one that cannot
                    if err.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
                    in_kernel = False
                    continue
            else:
                chunk = os.pread(source_fd, min(CHUNK, wanted), offset)
                copied = os.pwrite(target_fd, chunk, offset) if chunk else 0
            if copied == 0:
                raise OSError(errno.EIO, "the file shrank while it was copied")
            done += copied


def copy_with_digest(source: Path, target: Path) -> str:
    """Copy the file ``source`` to the new path ``target`` as :func:`copy_to_new_file` does, and
    return the :func:`sparse_digest` of what was copied, taken from the bytes as they were
    written. On failure ``target`` is removed.

    Why: a resume and each fork child copied the snapshot's disk image, read the copy back to
    hash it, and then waited, at the loop mount of it, for the copy's pages to reach the disk
    (0.12 s of each start for a 200 MB workspace here). Here the source is read once and the copy
    written past the page cache where its filesystem allows (uncached_io.py): what is hashed is
    what is written, and nothing of it is left to flush."""
    return _into_new_file(source, target, _copy_hashing)


def _copy_hashing(source_fd: int, target_fd: int) -> str:
    size = os.fstat(source_fd).st_size
    os.ftruncate(target_fd, size)
    digest = _digest_of_size(size)
    uncached = go_uncached(target_fd)
    with mmap.mmap(-1, UNCACHED_CHUNK) as buffer:  # page-aligned, as O_DIRECT needs
        for start, length in data_segments(source_fd):
            digest.update(SEGMENT_HEADER.pack(start, length))
            done = 0
            while done < length:
                wanted = min(UNCACHED_CHUNK, length - done)
                with memoryview(buffer) as view, view[:wanted] as data:
                    if os.preadv(source_fd, [data], start + done) != wanted:
                        raise OSError(errno.EIO, "the file shrank while it was copied")
                    digest.update(data)
                    uncached = _write_at(target_fd, data, start + done, uncached)
                done += wanted
    return digest.hexdigest()


def _write_at(fd: int, data: memoryview, offset: int, uncached: bool) -> bool:
    """Write all of ``data`` at ``offset``; whether ``fd`` is still uncached afterwards (a piece
    that is not block-aligned, the end of an odd-sized file, is written through the page cache)."""
    while data:
        try:
            written = os.pwrite(fd, data, offset)
        except OSError as err:
            if not (uncached and err.errno == errno.EINVAL):
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            uncached = False
            continue
        data, offset = data[written:], offset + written
    return uncached
