"""kernels/sandbox/uncached_io.py on real files: a file hashed through O_DIRECT (this host's
ext4) or through the page cache (a ramfs, which refuses O_DIRECT) gives hashlib's digest of its
bytes at every size around the chunk, a file shorter than the size asked for is an error, and
the hash of a large file leaves none of it in the page cache."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess

import pytest

from sandkernel.kernels.sandbox.uncached_io import CHUNK, hash_file, supports_uncached

SIZES = (0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 123)


@pytest.fixture
def ramfs(tmp_path):
    """A directory on a ramfs of its own (no O_DIRECT there)."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def _hashed(path, size: int) -> tuple[str, bool]:
    """hash_file's digest of ``path``, and whether the descriptor ended up O_DIRECT."""
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = hashlib.sha256()
        hash_file(fd, digest, size)
        return digest.hexdigest(), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["ext4", "ramfs"])
def test_every_size_hashes_to_hashlibs_digest_with_or_without_the_page_cache(tmp_path, ramfs, where):
    directory = tmp_path if where == "ext4" else ramfs
    assert supports_uncached(directory) is (where == "ext4")
    assert os.listdir(directory) == (["ramfs"] if where == "ext4" else [])  # the probe file is gone
    for size in SIZES:
        path = directory / f"f{size}"
        data = os.urandom(size)
        path.write_bytes(data)
        digest, uncached = _hashed(path, size)
        assert digest == hashlib.sha256(data).hexdigest(), size
        assert uncached is (where == "ext4")


@pytest.mark.parametrize("where", ["ext4", "ramfs"])
def test_a_file_shorter_than_asked_for_is_an_error(tmp_path, ramfs, where):
    path = (tmp_path if where == "ext4" else ramfs) / "short"
    path.write_bytes(os.urandom(2 * CHUNK + 10))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="shrank"):
            hash_file(fd, hashlib.sha256(), 3 * CHUNK)
    finally:
        os.close(fd)


def _cached_bytes(path) -> int:
    """How much of the file is in the page cache (util-linux's fincore)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], check=True, capture_output=True, text=True
    )
    return int(out.stdout.strip())


def test_a_large_file_is_hashed_without_filling_the_page_cache(tmp_path):
    path = tmp_path / "image"
    with open(path, "wb") as f:
        f.write(os.urandom(16 * CHUNK))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # written, then dropped from the cache
    assert _cached_bytes(path) < CHUNK
    digest, uncached = _hashed(path, 16 * CHUNK)
    assert uncached
    assert _cached_bytes(path) < CHUNK
    fd = os.open(path, os.O_RDONLY)  # the same hash through the page cache fills it: the check can fail
    try:
        assert hashlib.sha256(os.read(fd, 16 * CHUNK)).hexdigest() == digest
    finally:
        os.close(fd)
    assert _cached_bytes(path) == 16 * CHUNK
