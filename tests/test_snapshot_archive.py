"""Snapshot archives against real sandboxes (runc and runsc): a session's /workspace and /tmp
packed by tar inside one sandbox and unpacked inside another, as its own user.

Two sessions per runtime (module-scoped): ``source`` is packed, ``target`` is restored into,
the way resume and fork restore a snapshot into a fresh sandbox with a uid of its own. The host
side of the tests builds and inspects archives with :mod:`tarfile`; the code under test never
does (it only streams and hashes bytes).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import secrets
import socket
import tarfile
import time
from pathlib import Path

import pytest

from sandkernel.errors import SnapshotError, SnapshotQuotaError, SnapshotRejectedError
from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.model.profiles import Runtime
from sandkernel.kernels.sandbox.container import SANDBOX_PYTHON
from sandkernel.kernels.sandbox.exec_stream import (
    EXIT_GRACE,
    RELEASE_GRACE,
    Deadline,
    ExecStreamError,
    exec_pid,
    frames,
    is_containers_exec,
    kill_exec,
    start_held,
)
from sandkernel.kernels.sandbox.labels import process_start_time
from sandkernel.kernels.snapshots.archive import (
    KERNEL_TMP_FILES,
    ArchivePart,
    capture_files,
    files_fingerprint,
    restore_files,
)

from .conftest import ROOT, RUNTIME_PARAMS, require_runtime

MiB = 1024 * 1024

# Runs in the sandbox: every entry under /workspace and /tmp but the kernel's own files, as
# {path: [kind, mode, size, mtime, uid, content]} (content: sha256, a link's target, or None).
LISTING = r"""
import hashlib, json, os, stat, sys
spared = sys.argv[1:]
out = {}
for top in ("/workspace", "/tmp"):
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if any(path == s or path.startswith(s + "/") for s in spared):
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                kind, content = "link", os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    kind, content = "file", hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISDIR(st.st_mode):
                kind, content = "dir", None
            elif stat.S_ISFIFO(st.st_mode):
                kind, content = "fifo", None
            else:
                kind, content = "other", None
            size = st.st_size if kind == "file" else None
            mtime = int(st.st_mtime) if kind in ("file", "dir") else None
            out[path] = [kind, oct(stat.S_IMODE(st.st_mode)), size, mtime, st.st_uid, content]
print(json.dumps(out))
"""

# Runs in the sandbox: removes what earlier tests left (not the kernel's files, not .local).
RESET = r"""
import os, shutil, sys
spared = set(sys.argv[1:]) | {"/workspace/.local"}
for top in ("/workspace", "/tmp"):
    for dirpath, dirnames, _ in os.walk(top):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in spared]
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    for name in os.listdir(top):
        path = os.path.join(top, name)
        if path in spared:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
"""

# Runs in the source sandbox: one of each kind of thing a workspace holds.
POPULATE = r"""
import os
os.chdir("/workspace")
os.makedirs("data/nested/deep")
with open("data/nested/deep/file.txt", "w") as f: f.write("hello\n")
with open("blob.bin", "wb") as f: f.write(os.urandom(8 * 1024 * 1024))
with open("sparse.bin", "wb") as f: f.truncate(64 * 1024 * 1024)
os.link("data/nested/deep/file.txt", "hard-link.txt")
os.symlink("data/nested", "rel-link")
os.symlink("/etc/hostname", "abs-link")
os.symlink("no-such-target", "dangling-link")
os.makedirs("empty-dir")
with open("odd name\nwith a newline -rf", "w") as f: f.write("odd")
os.makedirs("tmp")  # /workspace/tmp/kernel.pid is the tenant's file, not the kernel's
with open("tmp/kernel.pid", "w") as f: f.write("the tenant's own")
with open("run.sh", "w") as f: f.write("#!/bin/sh\necho hi\n")
os.chmod("run.sh", 0o750)
os.utime("run.sh", (1600000000, 1600000000))
os.makedirs("locked")
with open("locked/inside.txt", "w") as f: f.write("behind 0500")
os.chmod("locked", 0o500)
os.makedirs("/tmp/scratch")
with open("/tmp/scratch/note.txt", "w") as f: f.write("a note in /tmp")
os.mkfifo("/tmp/a-fifo")
"""


@pytest.fixture(scope="module", params=RUNTIME_PARAMS)
async def pair(request):
    """Two sessions of one runtime: the one packed and the one restored into."""
    require_runtime(request.param)
    overrides = {"runtime": request.param, "pids": 128, "cpus": 0.5, "memory_mb": 512}
    source = await KernelSession.start(overrides=dict(overrides))
    try:
        target = await KernelSession.start(overrides=dict(overrides))
        try:
            yield source, target
        finally:
            await target.shutdown()
    finally:
        await source.shutdown()


async def sh(session: KernelSession, script: str) -> str:
    code, out = await session.container.run_as_sandbox(["/bin/sh", "-c", script], timeout=60)
    assert code == 0, out
    return out


async def py(session: KernelSession, code: str, *args: str) -> str:
    status, out = await session.container.run_as_sandbox([SANDBOX_PYTHON, "-I", "-c", code, *args], timeout=60)
    assert status == 0, out
    return out


async def listing(session: KernelSession) -> dict[str, list]:
    return json.loads(await py(session, LISTING, *KERNEL_TMP_FILES))


async def reset(session: KernelSession) -> None:
    await py(session, RESET, *KERNEL_TMP_FILES)


async def kernel_files(session: KernelSession) -> str:
    return await sh(session, "/usr/bin/sha256sum /tmp/kernel.json /tmp/kernel.pid")


async def one_plus_one(session: KernelSession) -> None:
    result = await session.execute("1 + 1", timeout=60)
    assert result.status is ExecutionStatus.OK, result
    assert result.outputs[0]["data"]["text/plain"] == "2"


async def captured(session: KernelSession, dest: Path, max_bytes: int = 512 * MiB) -> ArchivePart:
    part = await capture_files(session.container, dest, max_bytes)
    assert dest.stat().st_size == part.bytes
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == part.sha256
    assert dest.stat().st_mode & 0o777 == 0o600
    return part


# -- pure -------------------------------------------------------------------------------------


def test_kernel_tmp_files_cover_what_the_launcher_and_the_image_keep_in_tmp():
    """One place for the kernel's /tmp files: whatever launch-kernel writes there and every
    /tmp directory the image's environment names must be spared by snapshots."""
    launcher = (ROOT / "kernel-image" / "launch-kernel").read_text()
    dockerfile = (ROOT / "kernel-image" / "Dockerfile").read_text()
    written = set(re.findall(r"/tmp/[\w.-]+", launcher))
    env_dirs = set(re.findall(r"^\s+\w+=(/tmp/[\w.-]+)", dockerfile, re.M))
    assert written >= {"/tmp/kernel.json", "/tmp/kernel.pid"}, written
    assert env_dirs >= {"/tmp/.ipython"}, env_dirs
    assert written | env_dirs <= set(KERNEL_TMP_FILES), (written | env_dirs) - set(KERNEL_TMP_FILES)


def test_archive_part_round_trips_and_refuses_junk():
    part = ArchivePart(bytes=12, sha256="ab" * 32)
    assert ArchivePart.from_dict(json.loads(json.dumps(part.to_dict()))) == part
    junk = [
        None,
        [],
        {"bytes": 12},
        {"bytes": 12, "sha256": "ab" * 32, "extra": 1},
        {"bytes": -1, "sha256": "ab" * 32},
        {"bytes": True, "sha256": "ab" * 32},
        {"bytes": 1.5, "sha256": "ab" * 32},
        {"bytes": "12", "sha256": "ab" * 32},
        {"bytes": 12, "sha256": "AB" * 32},
        {"bytes": 12, "sha256": "ab" * 31},
        {"bytes": 12, "sha256": "../" + "a" * 61},
        {"bytes": 12, "sha256": 7},
    ]
    for data in junk:
        with pytest.raises(ValueError):
            ArchivePart.from_dict(data)


# -- against sandboxes ------------------------------------------------------------------------


async def test_files_round_trip_into_another_sandbox_as_its_own_user(pair, tmp_path):
    source, target = pair
    await reset(source)
    await reset(target)
    await py(source, POPULATE)
    # What the target had before is replaced, even behind a directory it made unwritable.
    await sh(
        target,
        "echo stale > /workspace/stale.txt && mkdir -p /tmp/stale/sub /workspace/ro && echo x > /workspace/ro/f "
        "&& chmod 500 /workspace/ro && echo x > /tmp/stale/sub/f",
    )
    kernel_before = await kernel_files(target)
    before = await listing(source)
    part = await captured(source, tmp_path / "files.tar")
    # Holes stay holes (--sparse) where the runtime shows them: 8 MiB of data and a 64 MiB
    # sparse file pack small. gVisor reports every block of a sparse file as allocated (and no
    # SEEK_DATA on its tmpfs), so there tar sees 64 MiB of zeros and packs them.
    if source.profile.runtime.value == "runc":
        assert part.bytes < 16 * MiB, part
    else:
        assert 72 * MiB < part.bytes < 80 * MiB, part

    t0 = time.monotonic()
    await restore_files(target.container, tmp_path / "files.tar", part)
    restore_seconds = time.monotonic() - t0
    after = await listing(target)

    source_uid, target_uid = source.container.spec.uid, target.container.spec.uid
    assert source_uid != target_uid
    # Same entries, kinds, modes, sizes, mtimes, contents and link targets...
    strip = {path: entry[:4] + entry[5:] for path, entry in before.items()}
    assert {path: entry[:4] + entry[5:] for path, entry in after.items()} == strip
    # ...every one owned by the target sandbox's own uid (tar unpacked as that user).
    assert {entry[4] for entry in after.values()} == {target_uid}, after
    assert {entry[4] for entry in before.values()} == {source_uid}
    # The things that had to survive the trip, by name.
    assert after["/workspace/rel-link"][0] == "link" and after["/workspace/rel-link"][5] == "data/nested"
    assert after["/workspace/abs-link"][5] == "/etc/hostname"
    assert after["/workspace/dangling-link"][0] == "link"
    assert after["/workspace/empty-dir"][0] == "dir"
    assert after["/workspace/run.sh"][1] == "0o750" and after["/workspace/run.sh"][3] == 1600000000
    assert after["/workspace/locked"][1] == "0o500"
    assert after["/workspace/odd name\nwith a newline -rf"][0] == "file"
    assert after["/workspace/tmp/kernel.pid"][0] == "file"  # excluded only at /tmp, not anywhere below
    assert after["/tmp/scratch/note.txt"][0] == "file"
    assert after["/tmp/a-fifo"][0] == "fifo"
    assert "/workspace/stale.txt" not in after and "/tmp/stale" not in after and "/workspace/ro" not in after
    # Links are links inside the sandbox: reading through them gives the sandbox's own files.
    assert (await sh(target, "cat /workspace/rel-link/deep/file.txt")) == "hello\n"
    # The target's kernel keeps its own files (not the source kernel's) and keeps working.
    assert await kernel_files(target) == kernel_before
    await one_plus_one(target)
    print(f"{source.profile.runtime.value}: {part.bytes} bytes restored in {restore_seconds:.2f} s")


async def test_a_tampered_or_truncated_archive_is_rejected_and_nothing_is_touched(pair, tmp_path):
    source, target = pair
    await reset(source)
    await sh(source, "echo 'the snapshot' > /workspace/data.txt")
    part = await captured(source, tmp_path / "files.tar")
    await reset(target)
    await sh(target, "echo 'still here' > /workspace/marker.txt")
    before = await listing(target)
    good = (tmp_path / "files.tar").read_bytes()

    flipped = bytearray(good)
    flipped[600] ^= 0x01  # one bit: the size is right, the hash is not
    cases = {
        "flipped": bytes(flipped),
        "truncated": good[:-1024],
        "extended": good + b"\0" * 512,
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SnapshotRejectedError):
            await restore_files(target.container, tmp_path / name, part)
    # A symlink in the archive's place is not followed on the host.
    (tmp_path / "link.tar").symlink_to(tmp_path / "files.tar")
    with pytest.raises(SnapshotRejectedError):
        await restore_files(target.container, tmp_path / "link.tar", part)
    assert await listing(target) == before
    # The good one still restores.
    await restore_files(target.container, tmp_path / "files.tar", part)
    assert (await sh(target, "cat /workspace/data.txt; cd /workspace && echo *")) == "the snapshot\ndata.txt\n"


async def test_over_the_limit_is_a_quota_error_and_leaves_no_file(pair, tmp_path):
    source, _ = pair
    await reset(source)
    await sh(source, "/usr/bin/head -c 4194304 /dev/urandom > /workspace/four-mib.bin")
    dest = tmp_path / "files.tar"
    with pytest.raises(SnapshotQuotaError, match=f"over the snapshot size limit of {MiB} bytes"):
        await capture_files(source.container, dest, MiB)
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []
    # A file already there (or a symlink planted there) is never written through or replaced.
    dest.write_bytes(b"someone else's")
    with pytest.raises(SnapshotError, match="cannot create"):
        await capture_files(source.container, dest, 64 * MiB)
    assert dest.read_bytes() == b"someone else's"
    link = tmp_path / "link.tar"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SnapshotError, match="cannot create"):
        await capture_files(source.container, link, 64 * MiB)
    assert not (tmp_path / "elsewhere").exists()
    # Under the limit it works.
    part = await captured(source, tmp_path / "ok.tar", 64 * MiB)
    assert 4 * MiB < part.bytes < 5 * MiB


async def test_tar_failing_in_the_sandbox_is_an_error_with_its_message(pair, tmp_path):
    source, _ = pair
    await reset(source)
    await sh(source, "echo secret > /workspace/unreadable && chmod 000 /workspace/unreadable")
    try:
        with pytest.raises(SnapshotError, match="unreadable: Cannot open: Permission denied") as caught:
            await capture_files(source.container, tmp_path / "files.tar", 64 * MiB)
        assert not isinstance(caught.value, SnapshotQuotaError)
        assert not (tmp_path / "files.tar").exists()
    finally:
        await sh(source, "chmod 600 /workspace/unreadable")


async def test_a_hostile_archive_writes_nothing_the_sandbox_user_could_not_and_never_the_host(pair, tmp_path):
    """An archive of absolute names, ``..``, symlinks to /etc and /tmp with files through them,
    a device node, and the kernel's own files: only /workspace and /tmp change, the kernel's files
    and the image stay as they were, the host is not touched, and the kernel keeps working."""
    _, target = pair
    await reset(target)
    host_canary = tmp_path / "host-canary"

    def entry(name: str, data: bytes = b"x", **attrs) -> tuple[tarfile.TarInfo, bytes | None]:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        for key, value in attrs.items():
            setattr(info, key, value)
        return info, (data if info.isreg() else None)

    members = [
        entry("workspace/", type=tarfile.DIRTYPE, mode=0o700),
        entry("tmp/", type=tarfile.DIRTYPE, mode=0o777),
        entry("workspace/ok.txt", b"fine"),
        entry("/etc/evil-absolute"),
        entry("workspace/../etc/evil-dotdot"),
        entry("workspace/../opt/sandkernel/evil-dotdot"),
        entry("workspace/etc-link", type=tarfile.SYMTYPE, linkname="/etc"),
        entry("workspace/etc-link/evil-through-link"),
        entry("workspace/tmp-link", type=tarfile.SYMTYPE, linkname="../tmp"),
        entry("workspace/tmp-link/kernel.pid", b"1"),
        entry("tmp/kernel.pid", b"1"),
        entry("tmp/kernel.json", b"{}"),
        entry("tmp/.ipython/profile_default/startup/00-evil.py", b"raise SystemExit\n"),
        entry("workspace/hard-to-passwd", type=tarfile.LNKTYPE, linkname="etc/passwd"),
        entry("workspace/device", type=tarfile.CHRTYPE, devmajor=1, devminor=3),
        entry("opt/sandkernel/launch-kernel", b"#!/bin/sh\necho owned\n"),
        entry(str(host_canary), b"host"),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    hostile = tmp_path / "hostile.tar"
    hostile.write_bytes(buf.getvalue())
    part = ArchivePart(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())

    # find's complaints (/etc/ssl/private is not the sandbox user's) go through sort too: the exec's
    # stdout and stderr arrive interleaved in no fixed order, and the comparison needs one.
    image = (
        "/usr/bin/sha256sum /etc/passwd /opt/sandkernel/launch-kernel; /usr/bin/find /etc /opt/sandkernel 2>&1 | sort"
    )
    image_before = await sh(target, image)
    kernel_before = await kernel_files(target)
    try:
        await restore_files(target.container, hostile, part)
    except SnapshotError as err:  # tar reports what it refused (the device, the hard link...)
        assert "tar exit" in str(err), err
    assert await sh(target, image) == image_before
    assert await kernel_files(target) == kernel_before
    assert not host_canary.exists()
    after = await listing(target)
    assert "/tmp/.ipython/profile_default/startup/00-evil.py" not in await sh(target, "find /tmp/.ipython")
    assert not any("evil" in path for path in after), after
    # The links are in the workspace as links, and nothing was written through them.
    assert after["/workspace/etc-link"][0] == "link" and after["/workspace/tmp-link"][0] == "link"
    assert after["/workspace/ok.txt"][0] == "file"
    assert "/workspace/device" not in after
    assert {entry[4] for entry in after.values()} == {target.container.spec.uid}
    await one_plus_one(target)


async def test_the_fingerprint_sees_any_change_to_the_files_but_the_kernels(pair):
    """What lets a resume skip putting the files back a second time: equal only while nothing
    under /workspace or /tmp changed (a touch, a write, a new file in /tmp), whatever the kernel
    writes to its own files meanwhile."""
    _, target = pair
    await reset(target)
    await sh(target, "echo a > /workspace/a; mkdir -p /workspace/d; echo t > /tmp/t")
    first = await files_fingerprint(target.container)
    assert first is not None and await files_fingerprint(target.container) == first
    await one_plus_one(target)  # the kernel logs and keeps its history: not the tenant's files
    assert await files_fingerprint(target.container) == first
    for change in ("touch -d '2001-01-01' /workspace/a", "echo b >> /tmp/t", "echo n > /workspace/d/n"):
        await sh(target, change)
        changed = await files_fingerprint(target.container)
        assert changed not in (None, first), change
        first = changed


async def test_a_helpers_process_waits_until_the_host_has_read_its_output(pair):
    """dockerd gives an exec's output 2 s after its process exits, then closes the stream: a
    loaded gateway read captures cut short. A held helper's shell exits only once the host read
    its trailer and closed the exec's stdin, so the output is whole whatever the host's lag, and
    the trailer carries the program's exit status.

    The release (the host's half-close) passes dockerd's stdin copy, its closer goroutine and
    containerd's CloseIO before the shell sees EOF, and a loaded host lost it once in a hog run
    (tests/README.md): the product does not rely on it, and kills a holder whose stream has not
    ended :data:`RELEASE_GRACE` seconds after its release. So the holder's process is gone by the
    end of that grace either way, ended by the release or killed.

    Whether it runs is read from the host's /proc (pid and start time), not from dockerd: a loaded
    dockerd records an exec's exit late, or (an exit event lost between the shim and dockerd) not
    at all, and the product never waits for that record once it has the trailer (a sixteenth-session
    CI run: dockerd still said "running" 10 s after the kill)."""
    source, _ = pair
    api = source.container.engine.client.api
    argv = ["/bin/sh", "-c", "head -c 300000 /dev/zero; exit 3"]

    def held_then_released() -> tuple[int, bool, bool, bool]:
        exec_id, sock, output = start_held(
            api, source.container.id, source.container.user, argv, Deadline(60), "x", "/"
        )
        try:
            size = 0
            for stream, data in frames(output.raw, Deadline(60), "x"):  # read without releasing it
                size += len(data) if stream == 1 else 0
                if data.endswith(output.token + b":003"):  # the trailer: the program's status, 3
                    break
            time.sleep(3)  # past dockerd's 2 s: an unheld exec would have exited and its stream closed
            pid = exec_pid(api, exec_id) or 0
            started = process_start_time(pid)
            held = started is not None and is_containers_exec(pid, source.container.id)
            output.raw.shutdown(socket.SHUT_WR)  # the release, as HeldOutput gives it
            killed = False
            try:
                next(frames(output.raw, Deadline(RELEASE_GRACE), "x"), None)
            except ExecStreamError:
                # The release was lost, or slower than the grace, on its way to the shell: the
                # product kills the holder, or finds it ended meanwhile (a release just late).
                killed = kill_exec(api, source.container.id, exec_id)
            # A killed process or one whose stream ended is gone at once; the shim reaps it.
            gone_by = time.monotonic() + EXIT_GRACE
            while process_start_time(pid) == started and time.monotonic() < gone_by:
                time.sleep(0.02)
            return size, held, killed, process_start_time(pid) != started
        finally:
            sock.close()

    size, held, killed, gone = await asyncio.to_thread(held_then_released)
    assert size == 300000 + 32 + len(":003")  # the program's bytes, then the trailer (token and status)
    assert held  # its process waited for the host, in this sandbox
    assert gone, f"the holder still runs after its release{' and a kill' if killed else ''}"


async def test_a_helper_given_up_on_is_killed_with_everything_it_started_on_the_host(pair):
    """kill_exec ends what a helper given up on runs on the host: under runc the holder, its
    program and that program's own children (a pipeline's commands are grandchildren: they were
    left running before); under gVisor its ``runsc exec``, which stands outside the container's
    cgroup (it was never found there, and stayed on the host until the session ended)."""
    source, _ = pair
    api, container_id = source.container.engine.client.api, source.container.id
    runc = source.container.spec.profile.runtime is Runtime.RUNC  # gVisor's processes are no host's
    seconds = f"1000.{secrets.randbelow(10**6)}"  # names this test's sleep among the sandbox's processes
    argv = ["/bin/sh", "-c", f"sleep {seconds} | cat"]

    def started_then_killed() -> tuple[bool, list[int]]:
        exec_id, sock, _ = start_held(api, container_id, source.container.user, argv, Deadline(60), "x", "/")
        try:
            pid = exec_pid(api, exec_id) or 0
            deadline = time.monotonic() + EXIT_GRACE
            while runc and not sleeping(container_id, seconds):  # until the pipeline runs
                assert time.monotonic() < deadline, "the helper's pipeline did not start"
                time.sleep(0.02)
            started = process_start_time(pid)
            killed = kill_exec(api, container_id, exec_id)

            def left() -> list[int]:
                alive = started is not None and process_start_time(pid) == started
                return [*([pid] if alive else []), *sleeping(container_id, seconds)]

            gone_by = time.monotonic() + EXIT_GRACE  # a killed process is gone at once; its reaping is due
            while left() and time.monotonic() < gone_by:
                time.sleep(0.02)
            return killed, left()
        finally:
            sock.close()

    killed, left = await asyncio.to_thread(started_then_killed)
    assert killed and left == [], f"left on the host: {left}"


def sleeping(container_id: str, seconds: str) -> list[int]:
    """The host processes in the container's cgroup that run this test's ``sleep``."""
    found = []
    wanted = f"sleep\0{seconds}\0".encode()
    for name in os.listdir("/proc"):
        try:
            if (
                name.isdigit()
                and Path(f"/proc/{name}/cmdline").read_bytes() == wanted
                and container_id in Path(f"/proc/{name}/cgroup").read_text()
            ):
                found.append(int(name))
        except OSError:
            continue
    return found
