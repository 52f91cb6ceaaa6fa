"""kernels/sandbox/sparse_files.py on real files of this host's filesystem: a copy keeps the
holes and the digest, any changed byte or moved hole changes the digest, and the snapshot store
counts what a sparse part takes on disk, not its size; a workspace image moved to another
filesystem is copied with its holes."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from sandkernel.kernels.sandbox.sparse_files import (
    allocated_bytes,
    copy_sparse,
    copy_with_digest,
    data_segments,
    sparse_digest,
)
from sandkernel.kernels.sandbox.workspace_disk import move_file
from sandkernel.kernels.snapshots.store import _tree_bytes

MiB = 1024 * 1024


def _sparse(path, pieces: dict[int, bytes], size: int = 64 * MiB):
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in pieces.items():
            f.seek(offset)
            f.write(data)
    return path


def _digest(path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return sparse_digest(fd)
    finally:
        os.close(fd)


def test_a_copy_keeps_the_data_the_holes_and_the_digest(tmp_path):
    source = _sparse(tmp_path / "a.img", {0: b"head" * 1024, 10 * MiB: os.urandom(MiB), 63 * MiB: b"tail"})
    target = tmp_path / "b.img"
    src, dst = os.open(source, os.O_RDONLY), os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        copy_sparse(src, dst)
        assert list(data_segments(dst)) == list(data_segments(src))
        assert len(list(data_segments(src))) == 3
        assert allocated_bytes(dst) < 2 * MiB and os.fstat(dst).st_size == 64 * MiB
    finally:
        os.close(src)
        os.close(dst)
    assert target.read_bytes() == source.read_bytes()
    assert _digest(target) == _digest(source)


@pytest.mark.parametrize("size", [64 * MiB, 64 * MiB + 1234])  # the second ends in a piece O_DIRECT cannot write
def test_a_copy_with_its_digest_is_the_same_file_hashed_once_and_left_uncached(tmp_path, size):
    tail = b"tail" if size % 4096 == 0 else os.urandom(5000)
    source = _sparse(
        tmp_path / "a.img", {0: b"head" * 1024, 10 * MiB: os.urandom(3 * MiB + 4096), 63 * MiB: tail}, size
    )
    target = tmp_path / "b.img"
    digest = copy_with_digest(source, target)
    assert digest == _digest(source) == _digest(target)
    assert target.read_bytes() == source.read_bytes() and stat.S_IMODE(target.stat().st_mode) == 0o600
    src, dst = os.open(source, os.O_RDONLY), os.open(target, os.O_RDONLY)
    try:
        assert list(data_segments(dst)) == list(data_segments(src))
    finally:
        os.close(src)
        os.close(dst)
    fd = os.open(target, os.O_RDONLY)
    try:  # written past the page cache: none of the copy's 3 MiB in the middle is in it
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drops clean pages only, not dirty ones
    finally:
        os.close(fd)
    resident = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(target)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert int(resident.stdout) < 64 * 1024  # at most the odd end; a copy through the cache keeps > 3 MiB there
    with pytest.raises(FileExistsError):  # never over an existing file
        copy_with_digest(source, target)
    assert _digest(target) == digest


def test_a_changed_byte_or_a_filled_hole_changes_the_digest(tmp_path):
    pieces = {0: b"a" * 8192, 8 * MiB: b"b" * 8192}
    original = _digest(_sparse(tmp_path / "a.img", pieces))
    assert _digest(_sparse(tmp_path / "b.img", {**pieces, 0: b"a" * 8191 + b"c"})) != original
    # The same bytes to read (zeros), but data where there was a hole: another digest.
    assert _digest(_sparse(tmp_path / "c.img", {**pieces, 4 * MiB: bytes(8192)})) != original
    assert _digest(_sparse(tmp_path / "d.img", pieces, size=65 * MiB)) != original  # another size
    assert _digest(_sparse(tmp_path / "e.img", pieces)) == original


def test_the_snapshot_store_counts_what_a_sparse_part_takes_on_disk(tmp_path):
    _sparse(tmp_path / "disk", {0: os.urandom(MiB)}, size=1024 * MiB)
    (tmp_path / "small").write_bytes(b"x" * 1000)
    assert MiB <= _tree_bytes(tmp_path) < 2 * MiB + 1000  # not the 1 GiB the image's size says


def test_a_workspace_image_moved_to_another_filesystem_keeps_its_holes(tmp_path):
    """A snapshot dir on another filesystem than the state dir (a shared one): the image cannot
    be renamed there, so it is copied, holes kept, and the source removed."""
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(other)], check=True)
    try:
        source = _sparse(tmp_path / "a.img", {0: b"x" * 8192, 32 * MiB: os.urandom(MiB)})
        digest = _digest(source)
        move_file(source, other / "a.img")
        assert not source.exists() and _digest(other / "a.img") == digest
        assert (other / "a.img").stat().st_blocks * 512 < 4 * MiB and (other / "a.img").stat().st_mode & 0o777 == 0o600
        with pytest.raises(FileExistsError):  # never over an existing file
            move_file(_sparse(tmp_path / "b.img", {0: b"y"}), other / "a.img")
    finally:
        subprocess.run(["umount", str(other)], check=True)
