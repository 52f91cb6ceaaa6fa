"""A saved kernel's memory (gVisor's checkpoint image) as parts of a snapshot.

runsc writes three files (kernels/sandbox/memory_checkpoint.py). Each becomes a part of the
snapshot, named here, so the image is sealed exactly as the files archive is: its size and
SHA-256 are in the signed manifest, the files are 0600 in the store's 0700 directories, and the
manifest binds them to one session and tenant. Before a restore every file is hashed again and
compared, and only then hard-linked, under runsc's names, into a directory of the gateway's own
for the new container: an image altered on disk is refused, never loaded.

Every function blocks on disk: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import stat
from pathlib import Path

from sandkernel.errors import SnapshotError, SnapshotRejectedError
from sandkernel.kernels.sandbox.uncached_io import hash_file
from sandkernel.kernels.snapshots.archive import ArchivePart
from sandkernel.kernels.snapshots.store import SnapshotDraft, SnapshotManifest, SnapshotStore

# Snapshot part -> the file runsc reads and writes for it.
MEMORY_PARTS = {"memory_state": "checkpoint.img", "memory_pages": "pages.img", "memory_meta": "pages_meta.img"}
# What a memory image may take beyond the sandbox's memory limit (runsc's own state and page
# metadata: 2 MB and a few KB for a 200 MB kernel), reserved from the quota before it is written.
IMAGE_OVERHEAD = 64 * 1024 * 1024
SCRATCH = "memory.new"  # where runsc writes, inside the draft's directory


def has_memory(manifest: SnapshotManifest) -> bool:
    """Whether the snapshot holds a memory image (every part of one)."""
    return all(name in manifest.parts for name in MEMORY_PARTS)


def image_bound(memory_mb: int) -> int:
    """The most a memory image of a sandbox with ``memory_mb`` of memory can take on disk."""
    return memory_mb * 1024 * 1024 + IMAGE_OVERHEAD


def scratch_dir(draft: SnapshotDraft) -> Path:
    """Where runsc writes the image (a path that does not exist yet; runsc's writer makes it)."""
    return draft.directory / SCRATCH


def seal_image(draft: SnapshotDraft) -> dict[str, ArchivePart]:
    """Move runsc's files from the scratch dir into the draft as parts: their sizes and hashes
    for the manifest. SnapshotError when the image is not the three files runsc writes."""
    scratch = scratch_dir(draft)
    found = sorted(os.listdir(scratch))
    if found != sorted(MEMORY_PARTS.values()):
        raise SnapshotError(f"the memory image holds {found}, not runsc's {sorted(MEMORY_PARTS.values())}")
    parts = {}
    for name, filename in MEMORY_PARTS.items():
        source = scratch / filename
        parts[name] = ArchivePart(bytes=os.lstat(source).st_size, sha256=_sha256(source, SnapshotError))
        os.chmod(source, 0o600)
        os.rename(source, draft.part_path(name))
    os.rmdir(scratch)
    return parts


def unseal_image(store: SnapshotStore, manifest: SnapshotManifest, target: Path) -> Path:
    """A directory (``target``, made 0700) holding the snapshot's memory image under runsc's
    names, each file hashed and compared with the signed manifest first (hard links to the
    parts). SnapshotRejectedError when a part is missing or altered; nothing is left then."""
    target.mkdir(mode=0o700)
    try:
        for name, filename in MEMORY_PARTS.items():
            part = manifest.parts.get(name)
            if part is None:
                raise SnapshotRejectedError(f"snapshot {manifest.snapshot_id} has no memory part {name!r}")
            path = store.part_path(manifest, name)
            digest = _sha256(path, SnapshotRejectedError, expected_size=part.bytes)
            if not hmac.compare_digest(digest, part.sha256):
                raise SnapshotRejectedError(
                    f"snapshot {manifest.snapshot_id}: its memory part {name!r} does not match its manifest "
                    "(altered); it is not restored"
                )
            os.link(path, target / filename, follow_symlinks=False)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def _sha256(path: Path, error: type[SnapshotError], expected_size: int | None = None) -> str:
    """The SHA-256 of a regular file of ours at ``path``, never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise error(f"memory image file {path.name} cannot be opened ({err.strerror})") from err
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise error(f"memory image file {path.name} is not a regular file of the gateway's")
        if expected_size is not None and st.st_size != expected_size:
            raise error(f"memory image file {path.name} has {st.st_size} bytes, not the {expected_size} recorded")
        digest = hashlib.sha256()
        try:
            hash_file(handle.fileno(), digest, st.st_size)
        except OSError as err:
            raise error(f"memory image file {path.name} cannot be read ({err.strerror})") from err
    return digest.hexdigest()
