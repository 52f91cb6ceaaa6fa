"""sandkernel.atomic, the one atomic writer (pure logic on a temp directory): old or new file,
never half of one, nothing left behind, nothing followed."""

from __future__ import annotations

import os
import stat

import nbformat
import pytest

from sandkernel import atomic
from sandkernel.notebooks.transcript import write_notebook_atomic


def test_replaces_whole_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "a" / "b" / "t.ipynb"  # parents are made
    atomic.write_atomic(target, "first")
    atomic.write_atomic(target, "second ✓")
    assert target.read_text() == "second ✓" and os.listdir(target.parent) == ["t.ipynb"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # transcripts hold whatever the code printed


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "t.ipynb").symlink_to(victim)
    atomic.write_atomic(tmp_path / "t.ipynb", b"new")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "t.ipynb").is_symlink() and (tmp_path / "t.ipynb").read_bytes() == b"new"


def test_a_failed_write_keeps_the_old_file_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "t.ipynb"
    atomic.write_atomic(target, "old")

    def no_rename(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", no_rename)
    with pytest.raises(OSError):
        atomic.write_atomic(target, "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["t.ipynb"]


def test_durable_writes_fsync_the_file_and_the_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    atomic.write_atomic(tmp_path / "quick", "x", durable=False)
    assert synced == []
    atomic.sync(tmp_path / "quick")
    assert synced == ["file", "dir"]
    synced.clear()
    write_notebook_atomic(nbformat.v4.new_notebook(), tmp_path / "nb.ipynb")  # replays, saved agent notebooks
    assert synced == ["file", "dir"]  # the rename is durable too, not only the data
    assert nbformat.read(tmp_path / "nb.ipynb", as_version=4).nbformat == 4


def test_sync_of_a_deleted_file_is_not_an_error(tmp_path):
    atomic.sync(tmp_path / "gone")
    atomic.sync(tmp_path / "no-dir" / "gone")


def test_an_invalid_notebook_is_refused_before_the_file_is_touched(tmp_path):
    target = tmp_path / "nb.ipynb"
    target.write_text("previous")
    broken = nbformat.v4.new_notebook()
    broken.cells.append(
        nbformat.from_dict({"cell_type": "code", "id": "c1", "source": "x", "metadata": {}})
    )  # no outputs
    with pytest.raises(nbformat.ValidationError):
        write_notebook_atomic(broken, target)
    assert target.read_text() == "previous" and os.listdir(tmp_path) == ["nb.ipynb"]
