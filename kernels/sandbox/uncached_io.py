"""Large files read and written past the host's page cache (``O_DIRECT``), where the filesystem allows.

Why: a gVisor memory image is hundreds of megabytes that the gateway writes once (runsc's
``--direct``), hashes once when it seals the snapshot and once more before a restore. Through the
page cache each pass takes new pages for the whole file, and on a host whose free memory is
given back to its hypervisor (a VM with a free page reporting balloon, as this project's CI
machine) touching new pages is the slow part: measured on this machine, hashing a 200 MB file
that is not cached took 0.55 s buffered and 0.24 s with ``O_DIRECT`` into one reused buffer, and
runsc's buffered write of a 200 MB image took 0.19 s or 0.7 s depending on which pages it got,
against 0.29 s every time with ``--direct`` (bench/README.md, session 21).

``O_DIRECT`` is set on a descriptor that was opened (and checked) as usual; a filesystem that
refuses it (ramfs, tmpfs before Linux 6.6) is used through the page cache as before. Every
function blocks on disk: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

CHUNK = 1024 * 1024  # a multiple of every block size O_DIRECT asks offsets and lengths to keep


class Hash(Protocol):
    """What :func:`hash_file` feeds (a ``hashlib`` object)."""

    def update(self, data: bytes | memoryview, /) -> None: ...


def go_uncached(fd: int) -> bool:
    """Set ``O_DIRECT`` on the open file ``fd``; False (and ``fd`` unchanged) where its
    filesystem does not support it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    return True


def hash_file(fd: int, digest: Hash, size: int) -> None:
    """Feed the ``size`` bytes of the open file ``fd`` to ``digest``, read uncached where its
    filesystem allows: the next chunk is read (in a thread of its own) while one is hashed, as
    both are about as fast here. OSError when the file holds fewer bytes than ``size``."""
    if not go_uncached(fd):
        offset = 0
        while offset < size:
            chunk = os.pread(fd, min(CHUNK, size - offset), offset)
            if not chunk:
                raise OSError(errno.EIO, "the file shrank while it was hashed")
            digest.update(chunk)
            offset += len(chunk)
        return
    with (
        mmap.mmap(-1, CHUNK) as ready,  # page-aligned, as O_DIRECT needs
        mmap.mmap(-1, CHUNK) as filling,
        ThreadPoolExecutor(1, thread_name_prefix="uncached-read") as reader,
    ):
        offset = 0
        reading = reader.submit(os.preadv, fd, [filling], offset)
        while offset < size:
            read = reading.result()
            if read < min(CHUNK, size - offset):  # short only at the end of the file
                raise OSError(errno.EIO, "the file shrank while it was hashed")
            offset += read
            ready, filling = filling, ready
            if offset < size:
                reading = reader.submit(os.preadv, fd, [filling], offset)
            with memoryview(ready) as view, view[:read] as data:
                digest.update(data)


def supports_uncached(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened ``O_DIRECT`` (a temporary file is made and
    removed there to ask its filesystem)."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=".direct-probe-")
    try:
        return go_uncached(fd)
    finally:
        os.close(fd)
        os.unlink(name)
