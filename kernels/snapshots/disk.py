"""A paused session's /workspace disk, kept whole as a part of its snapshot.

Why: packing the files through the sandbox's tar and unpacking them into a fresh disk at the
resume were the largest steps of a gVisor pause and resume (1.4 s and 1.0 s of 3.9 and 2.4 s
for a 200 MB workspace: every byte crosses the sandbox, the exec stream and the gateway). Once a
pause's sandbox has ended, its disk image (kernels/sandbox/workspace_disk.py) is the files,
exactly, with every open file, link and permission as the kernel left them: it is moved into the
snapshot, not read.

The image is sealed like every part: its SHA-256 (over its data segments: sparse_files.py) and
size are in the signed manifest, it is 0600 in the store's 0700 directories. Before a resume it
is copied (holes kept) into a directory of the gateway's own, hashed from the bytes as they are
written to the copy, and compared: what gets mounted is what was checked, and the snapshot stays
whole for another try if the resume fails. The part's size is the image's apparent size
(``workspace_mb``); what it takes on disk, and so against the tenant's quota, is what the files
take (the store counts allocated blocks).

Every function blocks on disk: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from sandkernel.errors import SnapshotError, SnapshotRejectedError
from sandkernel.kernels.sandbox.sparse_files import copy_with_digest, sparse_digest
from sandkernel.kernels.snapshots.archive import ArchivePart
from sandkernel.kernels.snapshots.store import SnapshotDraft, SnapshotManifest, SnapshotStore

DISK = "workspace_disk"  # the part's name
IMAGE_NAME = "workspace.img"  # the checked copy's name in the directory the caller gives


def has_disk(manifest: SnapshotManifest) -> bool:
    """Whether the snapshot keeps the workspace as a disk image (else a files archive, if any)."""
    return DISK in manifest.parts


def seal_disk(draft: SnapshotDraft) -> ArchivePart:
    """The image already moved to ``draft.part_path(DISK)`` as a part: its size and hash."""
    path = draft.part_path(DISK)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        return ArchivePart(bytes=os.fstat(fd).st_size, sha256=sparse_digest(fd))
    finally:
        os.close(fd)


def unseal_disk(store: SnapshotStore, manifest: SnapshotManifest, directory: Path) -> Path:
    """A checked copy of the snapshot's disk image in ``directory`` (an existing directory of
    the gateway's): copied, hashed as it is written, and compared with the signed manifest.
    SnapshotRejectedError when the part is missing or altered (the copy is removed then)."""
    part = manifest.parts.get(DISK)
    if part is None:
        raise SnapshotRejectedError(f"snapshot {manifest.snapshot_id} has no workspace disk")
    source, target = store.part_path(manifest, DISK), directory / IMAGE_NAME
    try:
        size = os.lstat(source).st_size
    except OSError as err:
        raise SnapshotRejectedError(
            f"snapshot {manifest.snapshot_id}: its workspace disk cannot be opened ({err.strerror})"
        ) from err
    if size != part.bytes:  # before a copy of what may be anything
        raise SnapshotRejectedError(
            f"snapshot {manifest.snapshot_id}: its workspace disk is not the size its manifest records (altered); "
            "it is not restored"
        )
    try:
        matches = hmac.compare_digest(copy_with_digest(source, target), part.sha256)  # what is mounted
    except OSError as err:
        target.unlink(missing_ok=True)
        raise SnapshotError(f"snapshot {manifest.snapshot_id}: its workspace disk could not be copied: {err}") from err
    if not matches:
        target.unlink()
        raise SnapshotRejectedError(
            f"snapshot {manifest.snapshot_id}: its workspace disk does not match its manifest (altered); "
            "it is not restored"
        )
    return target
