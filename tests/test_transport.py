"""Transport with no network: the host never follows a path the container controls."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from sandkernel.errors import TransportError
from sandkernel.kernels.sandbox.runtime_dir import RuntimeDir


class UnixListener:
    """A host unix socket standing in for docker.sock; counts who connects to it."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="skl-", dir="/tmp")
        self.path = os.path.join(self.dir, "host.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(self.dir)
        return self.connections


@pytest.fixture
def listener():
    lst = UnixListener()
    yield lst
    lst.close()


async def test_kernel_cannot_swap_its_socket_for_a_symlink(kernel_session, listener):
    result = await kernel_session.execute(
        f"""import os
target = {listener.path!r}
for name, attempt in [
    ("unlink", lambda: os.unlink('/run/sandkernel/k-1')),
    ("rename", lambda: os.rename('/run/sandkernel/k-1', '/run/sandkernel/old')),
    ("symlink", lambda: os.symlink(target, '/run/sandkernel/k-9')),
    ("create", lambda: open('/run/sandkernel/new', 'w')),
]:
    try:
        attempt(); print(name, 'SUCCEEDED')
    except OSError as e:
        print(name, 'refused', e.strerror)""",
        timeout=30,
    )
    lines = result.text.splitlines()
    assert len(lines) == 4 and all(" refused " in line for line in lines), result.text
    # The host connects afresh (a new client, as JupyterLab would) and reaches the real kernel.
    client = kernel_session.kernel_manager.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=30)
        reply = await client.kernel_info(reply=True, timeout=30)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
    rundir = kernel_session.provisioner.runtime_dir.path
    assert all(stat.S_ISSOCK(os.lstat(rundir / f"k-{port}").st_mode) for port in range(1, 6))
    assert sorted(os.listdir(rundir)) == ["connection.json", "k-1", "k-2", "k-3", "k-4", "k-5", "seccomp.json"]
    assert listener.connections == 0


def test_lock_refuses_a_symlinked_socket_without_connecting(listener):
    """A kernel that swapped a socket before the lock (a hostile image) is refused outright."""
    base = Path(tempfile.mkdtemp(prefix="skrt-", dir="/tmp"))
    rundir = RuntimeDir.create(base)
    real = []
    try:
        rundir.prepare({"key": "k", "signature_scheme": "hmac-sha256"})
        for port in range(2, 6):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(rundir.path / f"k-{port}"))
            real.append(s)
        os.symlink(listener.path, rundir.path / "k-1")
        assert rundir.sockets_ready()
        with pytest.raises(TransportError, match="k-1 is a symlink; refusing to connect"):
            rundir.lock()
        assert listener.connections == 0
    finally:
        for s in real:
            s.close()
        rundir.remove()
        base.rmdir()


def test_lock_refuses_a_regular_file():
    base = Path(tempfile.mkdtemp(prefix="skrt-", dir="/tmp"))
    rundir = RuntimeDir.create(base)
    try:
        rundir.prepare({"key": "k", "signature_scheme": "hmac-sha256"})
        for port in range(1, 6):
            (rundir.path / f"k-{port}").write_text("not a socket")
        with pytest.raises(TransportError, match="is not a socket"):
            rundir.lock()
    finally:
        rundir.remove()
        base.rmdir()


async def test_runtime_dir_is_relocked_after_restart(kernel_session):
    await kernel_session.restart()
    rundir = kernel_session.provisioner.runtime_dir.path
    assert stat.S_IMODE(os.stat(rundir).st_mode) == 0o755
    result = await kernel_session.execute("import os; print(os.access('/run/sandkernel', os.W_OK))", timeout=30)
    assert result.text == "False\n"


def test_runtime_dir_paths_fit_unix_socket_limits(tmp_path):
    deep = tmp_path / ("d" * 90)
    with pytest.raises(Exception, match="too deep for unix socket paths"):
        RuntimeDir.create(deep)


def test_the_shared_context_holds_as_many_sockets_as_the_file_limit_allows():
    """One context serves every session: libzmq's default of 1023 sockets would make ~200
    sessions the whole gateway's limit, and one tenant's websockets could use up the others'."""
    import resource

    import zmq

    from sandkernel.kernels.execution.transport import context_socket_limit, shared_context

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = max(1023, min(65535, soft // 2))
    assert shared_context().get(zmq.MAX_SOCKETS) == context_socket_limit(shared_context().get(zmq.SOCKET_LIMIT))
    assert context_socket_limit(65535) == expected
    assert context_socket_limit(500) == 1023  # never below libzmq's own default
    if soft >= 4096:
        assert shared_context().get(zmq.MAX_SOCKETS) > 1023
