"""Atomic file replacement on the host, in one place: a reader (or a crash) sees the old file or
the new one, never half of one.

Used for transcripts (notebooks/recorder.py, written after every cell), replays and saved agent
notebooks (notebooks/transcript.py). The steps, and why each is there:

1. The directory is opened once (``O_DIRECTORY``) and every later step works relative to that
   descriptor: if the directory is renamed or swapped for a symlink mid-write, the file still lands
   in the directory that was opened, not wherever the path now points. (Symlinks in the directory's
   own path are the operator's configuration, e.g. a notebook directory on another disk, and are
   resolved that once; nothing below the directory is ever followed.)
2. The data goes to a new temp file in that same directory (``O_CREAT | O_EXCL | O_NOFOLLOW``: a
   planted file or symlink of that name is refused, never written through), mode 0600 unless told
   otherwise (transcripts hold whatever the code printed).
3. ``fsync`` the temp file, ``rename`` it over the target (rename replaces a symlink at the target
   rather than following it), then ``fsync`` the directory so the rename itself is durable.
   ``durable=False`` skips both fsyncs for a caller that syncs later (the recorder coalesces them
   after a burst of cells, see :func:`sync`); the replacement is atomic either way.

Workspace files inside a sandbox are written by kernels/sandbox/workspace_files.py instead: that
runs inside the container as the sandbox user, because the host must never follow a path the
sandboxed code controls.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_atomic(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    durable: bool = True,
    mode: int = 0o600,
    make_parents: bool = True,
) -> None:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8) atomically.

    Called from worker threads (``asyncio.to_thread``): it blocks on disk I/O. ``make_parents``
    creates missing parent directories first. A symlink at ``path`` is replaced, not written
    through. Raises ``OSError`` (no space, not a directory, ...) and leaves no temp file behind.
    """
    target = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    dir_fd = os.open(target.parent, _DIR_FLAGS)
    try:
        tmp = f".{target.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, _TEMP_FLAGS, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(raw)
                handle.flush()
                if durable:
                    os.fsync(handle.fileno())
            os.replace(tmp, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sync(path: str | os.PathLike[str]) -> None:
    """Make an earlier ``write_atomic(..., durable=False)`` durable: fsync the file and its directory.

    A missing file (deleted meanwhile) is not an error; nothing is followed through a symlink.
    """
    target = Path(path)
    try:
        dir_fd = os.open(target.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        try:
            fd = os.open(target.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
