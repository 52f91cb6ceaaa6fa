"""The runtime dir (the kernel's socket dir, bind-mounted from the host) during and after a start.

It is never world-writable, it is writable by the kernel only while it starts, anything but the
five sockets and the host's two files is removed (and the kernel refused) after the lock, and
what a kernel can hold there is capped in size. Run as root (the suite's host): the dir gets a
tmpfs of its own and is handed to the sandbox group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandkernel.errors import TransportError
from sandkernel.kernels.sandbox.container import SANDBOX_GID, SandboxContainer
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.runtime_dir import CONNECTION_FILE, SECCOMP_FILE, RuntimeDir

pytestmark = pytest.mark.security

EXPECTED = sorted([CONNECTION_FILE, SECCOMP_FILE, "k-1", "k-2", "k-3", "k-4", "k-5"])
SANDBOX_UID = 0x7000_0000 + 4242  # a uid of the sandbox range no session uses in this test


def container_of(arena, session: dict) -> tuple[SandboxContainer, Path]:
    engine = default_engine()
    [found] = engine.client.containers.list(filters={"label": f"sandkernel.session={session['id']}"})
    spec = SimpleNamespace(user=found.attrs["Config"]["User"])
    return SandboxContainer(engine, found.id, spec), Path(found.labels["sandkernel.runtime_dir"])


async def test_mode_is_never_world_writable_during_a_restart(arena):
    _, rundir = container_of(arena, arena.attacker)
    modes: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.001):  # a sample a millisecond; the window lasts hundreds
            with contextlib.suppress(FileNotFoundError):
                modes.add(stat.S_IMODE(os.stat(rundir).st_mode))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        status, body = await arena.gateway.request("POST", f"/api/sessions/{arena.attacker['id']}/restart")
    finally:
        stop.set()
        await asyncio.to_thread(watcher.join)
    assert status == 200, body
    assert len(modes) > 1, "the watcher never saw the start window"
    assert not [oct(m) for m in modes if m & 0o002], f"runtime dir was world-writable: {sorted(map(oct, modes))}"
    assert stat.S_IMODE(os.stat(rundir).st_mode) == 0o755
    assert sorted(os.listdir(rundir)) == EXPECTED


async def test_kernel_cannot_add_or_change_entries_after_start(arena):
    result = await arena.probe(
        """
import json, os
d = '/run/sandkernel'
tries = {
    'file': lambda: os.close(os.open(d + '/x', os.O_CREAT | os.O_WRONLY)),
    'fifo': lambda: os.mkfifo(d + '/f'),
    'dir': lambda: os.mkdir(d + '/sub'),
    'hardlink': lambda: os.link(d + '/connection.json', d + '/hl'),
    'symlink': lambda: os.symlink('/etc/passwd', d + '/k-6'),
    'rename_socket': lambda: os.rename(d + '/k-1', d + '/k-9'),
    'unlink_host_file': lambda: os.unlink(d + '/seccomp.json'),
    'chmod': lambda: os.chmod(d, 0o777),
}
out = {}
for name, attempt in tries.items():
    try:
        attempt()
        out[name] = 'done'
    except OSError as err:
        out[name] = err.errno
print(json.dumps(out))
"""
    )
    assert "done" not in result.values(), result
    _, rundir = container_of(arena, arena.attacker)
    assert sorted(os.listdir(rundir)) == EXPECTED


# A profile config file of the tenant's: IPython runs it while the kernel starts, before its
# sockets exist, so inside the start window. It survives restarts (/tmp is kept).
WINDOW_CONFIG = r"""
import json, os, threading
d, report = '/run/sandkernel', {}
def attempt(name, fn):
    try:
        fn(); report[name] = 'done'
    except OSError as err:
        report[name] = err.errno
attempt('file', lambda: open(d + '/planted', 'w').write('x'))
attempt('fifo', lambda: os.mkfifo(d + '/fifo'))
attempt('dir', lambda: (os.mkdir(d + '/sub'), open(d + '/sub/inner', 'w').write('x')))
attempt('symlink', lambda: os.symlink('/etc/passwd', d + '/k-6'))
attempt('replace_seccomp', lambda: (open(d + '/s2', 'w').write('{}'), os.replace(d + '/s2', d + '/seccomp.json')))
attempt('unlink_connection', lambda: os.unlink(d + '/connection.json'))
def fill():  # an open handle the host cannot see once the file is removed
    written = 0
    try:
        fd = os.open(d + '/hog', os.O_CREAT | os.O_WRONLY)
        for _ in range(64):
            written += os.write(fd, b'\0' * (1 << 20))
    except OSError as err:
        report['hog_error'] = err.errno
    report['hog_bytes'] = written
    with open('/tmp/window-report.json', 'w') as f:
        json.dump(report, f)
t = threading.Thread(target=fill); t.start(); t.join()
"""
CONFIG_PATH = "/tmp/.ipython/profile_default/ipython_kernel_config.py"


async def test_entries_made_in_the_start_window_are_removed_and_the_kernel_refused(arena):
    sid = arena.attacker["id"]
    container, rundir = container_of(arena, arena.attacker)
    planted = await arena.attack(
        f"import os; os.makedirs(os.path.dirname({CONFIG_PATH!r}), exist_ok=True)\n"
        f"open({CONFIG_PATH!r}, 'w').write({WINDOW_CONFIG!r})"
    )
    assert planted["status"] == "ok", planted
    try:
        status, body = await arena.gateway.request("POST", f"/api/sessions/{sid}/restart")
        assert status >= 400, f"the kernel was accepted with planted entries: {body}"
        left = sorted(os.listdir(rundir))
        assert set(left) <= set(EXPECTED), f"planted entries survived the lock: {left}"
        assert stat.S_IMODE(os.stat(rundir).st_mode) == 0o755
        code, out = await container.run_as_sandbox(["/bin/cat", "/tmp/window-report.json"])
        assert code == 0, out
        report = json.loads(out)
    finally:
        code, out = await container.run_as_sandbox(["/bin/rm", "-f", CONFIG_PATH])
        assert code == 0, out
    # Under gVisor the filled tmpfs stays held until the container goes: the restart replaces it.
    status, body = await arena.gateway.request("POST", f"/api/sessions/{sid}/restart")
    assert status == 200, body
    assert report["file"] == "done", report  # the window was open to it, so the test saw the attack
    # Under runc the sticky bit stops both; gVisor lets a rename replace seccomp.json, which the
    # lock's check of the host's files then refuses (the kernel was refused above either way).
    assert report["unlink_connection"] != "done", report
    assert report["hog_bytes"] <= 2 << 20, f"a kernel held {report['hog_bytes']} bytes in its runtime dir"
    assert sorted(os.listdir(rundir)) == EXPECTED


def run_as_sandbox_user(code: str) -> dict:
    """Run Python as a sandbox uid and the sandbox group on the host (what the kernel is there)."""
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", code],
        user=SANDBOX_UID,
        group=SANDBOX_GID,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="the runtime dir's group and tmpfs need a root host")
def test_lock_removes_what_the_start_window_left_and_refuses():
    base = Path(tempfile.mkdtemp(prefix="skrt-", dir="/tmp"))
    rundir = RuntimeDir.create(base)
    os.chmod(base, 0o711)  # the host-side stand-in for the bind mount: lets the sandbox uid reach it
    try:
        rundir.prepare({"key": "k", "signature_scheme": "hmac-sha256"}, SANDBOX_GID)
        st = os.stat(rundir.path)
        assert st.st_gid == SANDBOX_GID and stat.S_IMODE(st.st_mode) == 0o1770
        report = run_as_sandbox_user(
            f"""
import json, os, socket
d, out, keep = {str(rundir.path)!r}, {{}}, []
for port in range(1, 6):
    s = socket.socket(socket.AF_UNIX); s.bind(f'{{d}}/k-{{port}}'); keep.append(s)
def attempt(name, fn):
    try:
        fn(); out[name] = 'done'
    except OSError as err:
        out[name] = err.errno
attempt('file', lambda: open(d + '/planted', 'w').write('x'))
attempt('fifo', lambda: os.mkfifo(d + '/fifo'))
attempt('dir', lambda: (os.mkdir(d + '/sub'), open(d + '/sub/f', 'w').write('x')))
attempt('symlink', lambda: os.symlink('/etc/shadow', d + '/k-6'))
attempt('replace_seccomp', lambda: os.rename(d + '/planted', d + '/seccomp.json'))
attempt('chmod_dir', lambda: os.chmod(d, 0o777))
written = 0
try:
    fd = os.open(d + '/hog', os.O_CREAT | os.O_WRONLY)
    for _ in range(16):
        written += os.write(fd, b'\\0' * (1 << 20))
except OSError as err:
    out['hog_error'] = err.errno
out['hog_bytes'] = written
print(json.dumps(out))
"""
        )
        assert report["file"] == report["fifo"] == report["dir"] == report["symlink"] == "done", report
        assert report["replace_seccomp"] != "done" and report["chmod_dir"] != "done", report
        assert report["hog_bytes"] <= 2 << 20, report
        with pytest.raises(TransportError, match="unexpected entries"):
            rundir.lock()
        assert sorted(os.listdir(rundir.path)) == EXPECTED
        assert stat.S_IMODE(os.stat(rundir.path).st_mode) == 0o755
    finally:
        rundir.remove()
        assert not os.path.ismount(rundir.path) and not rundir.path.exists()
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root host")
def test_lock_refuses_a_replaced_host_file(tmp_path):
    rundir = RuntimeDir.create(tmp_path / "rt")
    try:
        rundir.prepare({"key": "k", "signature_scheme": "hmac-sha256"}, SANDBOX_GID)
        for port in range(1, 6):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(rundir.path / f"k-{port}"))
            s.close()
        (rundir.path / SECCOMP_FILE).unlink()
        (rundir.path / SECCOMP_FILE).write_text('{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}')
        started = time.monotonic()
        with pytest.raises(TransportError, match="not the file the host wrote"):
            rundir.lock()
        assert time.monotonic() - started < 5
    finally:
        rundir.remove()
