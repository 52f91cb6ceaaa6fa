"""Pure tests of the accounting's pieces: the workspace scan and diff (a hostile tree in a tmp
dir, including a directory swapped for a symlink mid-walk and a file swapped before it is
hashed), the cgroup v1/v2 readers against tmp dirs laid out like /sys/fs/cgroup, and the
fanotify change flag on a tmpfs of the test's own (root: it mounts one)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from sandkernel.kernels.sandbox import cgroup, workspace_scan
from sandkernel.kernels.sandbox.fs_changes import ChangeWatch, Unavailable
from sandkernel.kernels.sandbox.workspace_scan import diff, package_changes, snapshot

CID = "ab" * 32


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace and, beside it, a "host" directory holding a secret the scan must never read."""
    ws, outside = tmp_path / "ws", tmp_path / "host"
    ws.mkdir()
    outside.mkdir()
    (outside / "secret-name.txt").write_bytes(b"host secret")
    return ws, outside


def test_created_modified_deleted_with_hashes_and_exclusions(host):
    ws, _ = host
    (ws / "keep.txt").write_text("v1")
    (ws / "old.txt").write_text("old")
    (ws / "d").mkdir()
    before = snapshot(ws)
    (ws / "keep.txt").write_text("v2 longer")
    (ws / "old.txt").unlink()
    (ws / "d" / "e").mkdir()
    (ws / "d" / "e" / "new.bin").write_bytes(b"\0" * 5000)
    for hidden in (".cache", ".ipython"):
        (ws / hidden).mkdir()
        (ws / hidden / "x").write_text("not a user file")
    site = ws / ".local" / "lib" / "python3.11" / "site-packages"
    (site / "sk_demo_pkg-1.0.dist-info").mkdir(parents=True)
    (site / "sk_demo_pkg").mkdir()
    after = snapshot(ws)
    files, notes = diff(ws, before, after)
    assert files == {
        "created": [{"path": "d/e/new.bin", "size": 5000, "sha256": sha(b"\0" * 5000)}],
        "modified": [{"path": "keep.txt", "size": 9, "sha256": sha(b"v2 longer")}],
        "deleted": [{"path": "old.txt"}],
        "hashed": 2,
        "unhashed": 0,
        "omitted": 0,
    }
    assert notes == []
    assert package_changes(before, after) == {"installed": ["sk_demo_pkg==1.0"], "removed": []}


def test_planted_symlinks_are_listed_never_followed(host):
    ws, outside = host
    before = snapshot(ws)
    (ws / "to-file").symlink_to(outside / "secret-name.txt")
    (ws / "to-dir").symlink_to(outside)
    (ws / ".local").symlink_to(outside)  # pip's prefix replaced by a link: no packages read through it
    os.mkfifo(ws / "fifo")
    after = snapshot(ws)
    files, _ = diff(ws, before, after)
    text = json.dumps(files)
    assert "secret-name" not in text and sha(b"host secret") not in text
    by_path = {item["path"]: item for item in files["created"]}
    assert by_path["to-file"]["type"] == "link" and by_path["to-file"]["sha256"] is None
    assert by_path["to-dir"]["type"] == "link" and by_path["fifo"]["type"] == "other"
    assert set(by_path) == {"to-file", "to-dir", "fifo"} and files["unhashed"] == 0
    assert after.packages == frozenset()


def test_a_directory_swapped_for_a_symlink_mid_walk_is_not_entered(host, monkeypatch):
    """The race os.fwalk loses: the entry is a directory when listed and stat'ed, and a symlink
    to a host directory when opened. The scan must neither enter it nor open what it names."""
    ws, outside = host
    (ws / "sub").mkdir()
    (ws / "sub" / "mine.txt").write_text("mine")
    real_lstat = os.lstat

    def lstat_then_swap(name, *args, **kwargs):
        st = real_lstat(name, *args, **kwargs)
        if name == "sub" and (ws / "sub").is_dir() and not (ws / "sub").is_symlink():
            os.rename(ws / "sub", ws / "sub.moved")
            os.symlink(outside, ws / "sub")
        return st

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    snap = snapshot(ws)
    monkeypatch.undo()
    assert not any("secret-name" in path for path in snap.entries), sorted(snap.entries)
    assert "sub/mine.txt" not in snap.entries  # not walked through the link either


def test_a_file_swapped_for_a_symlink_before_hashing_is_not_read(host):
    ws, outside = host
    before = snapshot(ws)
    (ws / "d").mkdir()
    (ws / "d" / "secret-name.txt").write_text("mine")
    (ws / "f").write_text("mine")
    after = snapshot(ws)
    # After the walk, before the hash: the file becomes a link to the host file, and the
    # directory a link to the host directory holding a file of the same name.
    (ws / "f").unlink()
    (ws / "f").symlink_to(outside / "secret-name.txt")
    os.rename(ws / "d", ws / "d.moved")
    (ws / "d").symlink_to(outside)
    files, notes = diff(ws, before, after)
    assert sha(b"host secret") not in json.dumps(files)
    assert all(item["sha256"] is None for item in files["created"]), files
    assert files["unhashed"] == 2 and any("not hashed" in note for note in notes)


def test_caps_are_said(tmp_path):
    ws = tmp_path
    before = snapshot(ws)
    for i in range(5):
        (ws / f"f{i}").write_bytes(b"x" * (i + 1) * 10)
    after = snapshot(ws)
    files, notes = diff(ws, before, after, max_hashed_files=2)
    assert [item["sha256"] is not None for item in files["created"]] == [True, True, False, False, False]
    assert (files["hashed"], files["unhashed"]) == (2, 3) and any("not hashed" in n for n in notes)
    files, notes = diff(ws, before, after, max_hashed_bytes=30)  # 10 + 20 bytes: the first two only
    assert (files["hashed"], files["unhashed"]) == (2, 3)
    files, notes = diff(ws, before, after, max_listed=3)
    assert len(files["created"]) == 3 and files["omitted"] == 2 and any("not listed" in n for n in notes)
    truncated = snapshot(ws, max_entries=3)
    assert truncated.truncated and len(truncated.entries) == 3
    files, notes = diff(ws, after, truncated)
    assert files["deleted"] == [] and any("entries" in n for n in notes)  # unseen is not deleted
    deep = ws / "deep"
    path = deep
    for _ in range(5):
        path = path / "d"
    path.mkdir(parents=True)
    shallow = snapshot(ws, max_depth=3)
    assert shallow.too_deep and not any(p.count("/") >= 3 for p in shallow.entries)


def test_names_that_are_not_utf8_come_out_as_json_text(tmp_path):
    before = snapshot(tmp_path)
    with open(os.path.join(os.fsencode(tmp_path), b"bad-\xff\n.txt"), "wb") as f:
        f.write(b"x")
    files, _ = diff(tmp_path, before, snapshot(tmp_path))
    assert files["created"][0]["path"] == "bad-\\xff\n.txt"
    json.dumps(files).encode("utf-8")


def test_a_file_changing_while_hashed_gets_no_hash(tmp_path, monkeypatch):
    before = snapshot(tmp_path)
    (tmp_path / "growing").write_bytes(b"a" * 100)
    after = snapshot(tmp_path)
    real_read = os.read

    def read_and_grow(fd, n):
        data = real_read(fd, n)
        with open(tmp_path / "growing", "ab") as f:
            f.write(b"more")
        return data

    monkeypatch.setattr(workspace_scan.os, "read", read_and_grow)
    files, _ = diff(tmp_path, before, after)
    assert files["created"][0]["sha256"] is None and files["unhashed"] == 1


# -- cgroups ----------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v1_layout_is_found_and_read(tmp_path):
    cpuacct, memory = tmp_path / "cpuacct" / "docker" / CID, tmp_path / "memory" / "docker" / CID
    _write(cpuacct / "cpuacct.usage", "3000000000\n")
    _write(cpuacct / "cpuacct.usage_user", "2000000000\n")
    _write(cpuacct / "cpuacct.usage_sys", "1000000000\n")
    _write(memory / "memory.max_usage_in_bytes", "999\n")
    _write(memory / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    found = cgroup.locate(CID, tmp_path)
    assert isinstance(found, cgroup.CgroupV1)
    assert found.cpu_times() == cgroup.CpuTimes(3.0, 2.0, 1.0)
    window = found.open_peak()
    assert (memory / "memory.max_usage_in_bytes").read_text().startswith("0")  # the reset the kernel reads as "now"
    _write(memory / "memory.max_usage_in_bytes", "4096\n")
    assert window.peak() == (4096, None)
    assert cgroup.oom_kills(found) == 2 and cgroup.container_oom_kills(CID, tmp_path) == 2
    (cpuacct / "cpuacct.usage_user").unlink()  # an older kernel: the split comes from cpuacct.stat
    found.close()  # (the files read so far were kept open; a real kernel never had this one)
    _write(cpuacct / "cpuacct.stat", f"user {2 * os.sysconf('SC_CLK_TCK')}\nsystem 0\n")
    assert found.cpu_times() == cgroup.CpuTimes(3.0, 2.0, 0.0)
    # The exact total, split in the proportion the kernel sampled (here 1.0 : 0.5 of ticks).
    assert cgroup.CpuTimes(4.5, 3.0, 0.5).since(found.cpu_times()) == cgroup.CpuTimes(1.5, 1.0, 0.5)
    assert cgroup.CpuTimes(3.3, 2.5, 0.0).since(found.cpu_times()) == cgroup.CpuTimes(0.3, 0.3, 0.0)
    assert cgroup.CpuTimes(3.001, 2.0, 0.0).since(found.cpu_times()) == cgroup.CpuTimes(0.001, None, None)  # no tick


def test_v2_layout_is_found_and_read(tmp_path):
    _write(tmp_path / "cgroup.controllers", "cpu memory\n")
    group = tmp_path / "system.slice" / f"docker-{CID}.scope"
    _write(group / "cpu.stat", "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 0\n")
    _write(group / "memory.peak", "1000\n")
    _write(group / "memory.current", "800\n")
    _write(group / "memory.events", "low 0\nhigh 0\nmax 4\noom 3\noom_kill 3\noom_group_kill 0\n")
    found = cgroup.locate(CID, tmp_path)
    assert isinstance(found, cgroup.CgroupV2) and found.path == group
    assert found.cpu_times() == cgroup.CpuTimes(2.5, 2.0, 0.5)
    assert cgroup.container_oom_kills(CID, tmp_path) == 3
    # Kernel >= 6.12: the window holds an fd whose writes reset its own view of the peak.
    window = found.open_peak()
    _write(group / "memory.peak", "5000\n")  # what the kernel would answer through that fd
    assert window.peak() == (5000, None)
    window.close()
    window.close()


def test_v2_without_per_fd_reset_falls_back_honestly(tmp_path):
    group = tmp_path / "docker" / CID
    _write(tmp_path / "cgroup.controllers", "cpu memory\n")
    _write(group / "cpu.stat", "usage_usec 1\nuser_usec 1\nsystem_usec 0\n")
    _write(group / "memory.peak", "1000\n")
    _write(group / "memory.current", "300\n")
    found = cgroup.CgroupV2(group, per_fd_peak=False)
    window = found.open_peak()
    _write(group / "memory.peak", "1500\n")  # the lifetime peak rose during the cell: it is the cell's
    assert window.peak() == (1500, None)
    window = found.open_peak()
    _write(group / "memory.current", "400\n")  # it did not: the samples stand in, said so
    peak, note = window.peak()
    assert peak == 400 and note == cgroup.APPROXIMATE_PEAK


def test_locate_refuses_what_is_not_a_container_id(tmp_path):
    _write(tmp_path / "cpuacct" / "docker" / "x" / "cpuacct.usage", "1\n")
    _write(tmp_path / "memory" / "docker" / "x" / "memory.max_usage_in_bytes", "1\n")
    assert cgroup.locate("x", tmp_path) is None
    assert cgroup.locate("../" + CID, tmp_path) is None
    assert cgroup.locate(CID, tmp_path) is None  # no such container
    assert cgroup.container_oom_kills(CID, tmp_path) is None and cgroup.container_oom_kills("x", tmp_path) is None


@pytest.fixture
def own_fs(tmp_path: Path):
    """A tmpfs mounted at ``tmp_path/fs`` (a filesystem of its own, like a workspace disk)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=False, capture_output=True)


def test_the_change_flag_sees_what_another_process_does_and_not_our_own_scan(own_fs):
    watch = ChangeWatch(own_fs)

    def elsewhere(script: str) -> None:  # another process, as the sandbox is
        subprocess.run(["sh", "-c", script], cwd=own_fs, check=True)

    try:
        assert watch.changed() is False
        for script in (
            "echo a > a",  # create, modify, close
            "echo b >> a",
            "truncate -s 0 a",
            "touch -d @1 a",  # attrib
            "chmod 600 a",
            "mv a b",
            "ln b c",
            "ln -s /etc/passwd link",
            "mkfifo fifo",
            "mkdir -p d/e",
            "rmdir d/e",
            "rm c",
            "cat b",  # an open (a memory mapping needs one; its stores make no event)
            "ls d",
        ):
            elsewhere(script)
            assert watch.changed() is True, script
            assert watch.changed() is False  # drained
        (own_fs / "b").write_text("ours")  # the host itself writes (never in sandkernel)
        own = watch.changed()
        snap = workspace_scan.snapshot(own_fs)  # the meter's own walk and hashing: opens of ours
        diff(own_fs, workspace_scan.Snapshot(), snap)
        assert watch.changed() is False and own is False
    finally:
        watch.close()
        watch.close()
    with pytest.raises(Unavailable):
        watch.changed()


def test_a_flood_overflows_into_one_changed_and_drains_whole(own_fs):
    watch = ChangeWatch(own_fs)
    try:
        # More events than the queue holds (16384 by default), from another process: it overflows.
        subprocess.run(["python3", "-c", "for i in range(20_000): open(str(i), 'w').close()"], cwd=own_fs, check=True)
        assert watch.changed() is True
        assert watch.changed() is False
    finally:
        watch.close()


def test_the_watch_does_not_hold_the_filesystem_and_notices_it_is_gone(own_fs):
    watch = ChangeWatch(own_fs)
    try:
        subprocess.run(["sh", "-c", "echo a > a"], cwd=own_fs, check=True)  # queued: FID events pin nothing
        subprocess.run(["umount", str(own_fs)], check=True)  # not EBUSY
        with pytest.raises(Unavailable, match="unmounted or remounted"):
            watch.changed()
    finally:
        watch.close()


def test_a_directory_that_is_not_a_mount_is_not_watched(tmp_path):
    with pytest.raises(Unavailable, match="not a filesystem of its own"):
        ChangeWatch(tmp_path)  # a mark there would watch the host filesystem that holds it
    with pytest.raises(Unavailable, match="cannot be read"):
        ChangeWatch(tmp_path / "missing")
