"""dockerd restarts under live sessions (issue 13, item 5).

Pure tier: the engine's translation of a missing, refusing or call-dropping Docker socket into
DockerUnavailableError (503), the one retry of a read, and the reconnect after a restart,
against a real HTTP server on a unix socket standing in for dockerd (scripted answers).

Docker tier (``slow``): with live-restore on, sessions under runc and runsc keep their
variables, files and containers (same id, same StartedAt) across a dockerd restart, answer
executes while dockerd is down, and interrupt and restart work again once it is back. It
restarts the machine's dockerd, which breaks the Docker calls of anything else using it; on a
shared machine give it a private dockerd instead (``SANDKERNEL_TEST_DOCKERD_ARGS``, below).
Without live-restore a dockerd stop kills the containers (exit 137): the test fails first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import docker
import pytest

from sandkernel.errors import DockerUnavailableError
from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.service_cpu import engine_placement, place_engine

from .conftest import RunscState, runsc_required, runsc_state

# -- pure: a stand-in dockerd on a unix socket ---------------------------------------------------


class FakeDockerd:
    """An HTTP/1.1 server on a unix socket that answers every request with ``{"Id": ...}``,
    keeping connections alive like dockerd; ``drop`` connections are closed unanswered (a daemon
    dying mid-call). :meth:`restart` closes every connection and the socket, then listens again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[str] = []
        self.drop = 0
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.listen()

    def listen(self) -> None:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(self.path))
        listener.listen()
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        assert self._listener is not None and self._acceptor is not None
        # shutdown wakes the thread blocked in accept() (close alone does not): a thread left
        # there could call accept() on the fd number once a later socket of the test run reuses it.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5)
        assert not self._acceptor.is_alive(), "the fake dockerd's accept thread did not end"
        self._listener.close()
        self.path.unlink()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._conns.clear()

    def restart(self) -> None:
        self.stop()
        self.listen()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"\r\n\r\n" in buffer:
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                line = head.split(b"\r\n", 1)[0].decode()
                self.requests.append(line)
                if self.drop:
                    self.drop -= 1
                    conn.close()
                    return
                body = json.dumps({"Id": line, "State": {"Running": True}}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )


@pytest.fixture
def fake_dockerd(tmp_path):
    server = FakeDockerd(tmp_path / "docker.sock")
    yield server
    with contextlib.suppress(OSError, AssertionError):
        server.stop()


def engine_for(server: FakeDockerd) -> DockerEngine:
    return DockerEngine(docker.DockerClient(base_url=f"unix://{server.path}", version="1.41", timeout=10))


async def test_a_restarted_engine_is_reconnected_to_without_help(fake_dockerd):
    engine = engine_for(fake_dockerd)
    api = engine.client.api
    assert (await engine.run(api.inspect_container, "a"))["Id"].startswith("GET ")
    fake_dockerd.restart()  # the pooled keep-alive connection is now dead
    await engine.run(api.kill, "a")  # a write, never retried: it went through on a new connection
    assert len(fake_dockerd.requests) == 2 and fake_dockerd.requests[1].startswith("POST /v1.41/containers/a/kill")


async def test_while_the_engine_is_away_calls_fail_with_503_and_work_once_it_is_back(fake_dockerd):
    engine = engine_for(fake_dockerd)
    api = engine.client.api
    await engine.run(api.inspect_container, "a")
    fake_dockerd.stop()  # the socket is gone, as while dockerd restarts
    for call in (api.inspect_container, api.kill):
        with pytest.raises(DockerUnavailableError, match="may be restarting") as caught:
            await engine.run(call, "a")
        assert caught.value.http_status == 503
    fake_dockerd.listen()
    assert (await engine.run(api.inspect_container, "a"))["State"]["Running"] is True


async def test_a_read_dropped_mid_call_is_sent_once_more_and_a_write_never(fake_dockerd):
    engine = engine_for(fake_dockerd)
    api = engine.client.api
    fake_dockerd.drop = 1
    assert (await engine.run(api.inspect_container, "a"))["Id"] == "GET /v1.41/containers/a/json HTTP/1.1"
    assert len(fake_dockerd.requests) == 2

    fake_dockerd.drop = 1
    with pytest.raises(DockerUnavailableError):
        await engine.run(api.kill, "a")  # it may have happened: never sent twice
    assert len(fake_dockerd.requests) == 3

    fake_dockerd.drop = 2
    with pytest.raises(DockerUnavailableError):
        await engine.run(api.inspect_container, "a")  # one retry, not a loop
    assert len(fake_dockerd.requests) == 5


# -- docker: the machine's dockerd, restarted -----------------------------------------------------

# The dockerd to restart: the machine's, started as plain ``dockerd`` the way scripts/host-setup.sh
# does (pid in /var/run/docker.pid, log /var/log/dockerd.log); or a private one, given by its
# command-line arguments in SANDKERNEL_TEST_DOCKERD_ARGS (with --pidfile; DOCKER_HOST points at its
# socket; its log beside the pid file). Restarting a private dockerd breaks nobody else's calls.
DOCKERD_ARGS_ENV = "SANDKERNEL_TEST_DOCKERD_ARGS"
DOCKERD_DOWN_SECONDS = 3.0  # how long executes are tried with no dockerd at all


def dockerd_args() -> list[str]:
    return shlex.split(os.environ.get(DOCKERD_ARGS_ENV, ""))


def dockerd_pidfile() -> Path:
    args = dockerd_args()
    return Path(args[args.index("--pidfile") + 1]) if "--pidfile" in args else Path("/var/run/docker.pid")


def dockerd_log() -> Path:
    return dockerd_pidfile().with_name("dockerd.log") if dockerd_args() else Path("/var/log/dockerd.log")


def dockerd_pid() -> int | None:
    """The pid of the dockerd to restart, if it runs and is ``dockerd``."""
    try:
        pid = int(dockerd_pidfile().read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None
    return pid if comm == "dockerd" else None


def docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def stop_dockerd(pid: int) -> None:
    """SIGTERM, as a service manager stops it; with live-restore the containers stay up."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not dockerd_gone(pid):
        assert time.monotonic() < deadline, "dockerd did not stop within 60 s"
        time.sleep(0.1)


def dockerd_gone(pid: int) -> bool:
    """Whether the process has exited. A dockerd that an earlier test started again is this
    process's child: it stays a zombie (its /proc entry too) until reaped, so reap it here."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def start_dockerd(weighed: bool) -> None:
    """Start dockerd again the same way (in its own session, appending to its log), back in the
    engine's CPU group when it was there (``weighed``: scripts/host-setup.sh put it there, and
    the rest of the suite runs on this host as it was set up)."""
    with dockerd_log().open("ab") as log:
        subprocess.Popen(
            ["dockerd", *dockerd_args()], stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while not docker_answers():
        assert time.monotonic() < deadline, f"dockerd did not come back within 120 s; see {dockerd_log()}"
        time.sleep(0.5)
    if weighed:
        place_engine()


def started(session: KernelSession) -> tuple[str, str, bool]:
    state = default_engine().client.api.inspect_container(session.container.id)
    return state["Id"], state["State"]["StartedAt"], state["State"]["Running"]


async def value(session: KernelSession, code: str) -> str:
    result = await session.execute(code, timeout=60)
    assert result.status is ExecutionStatus.OK, result
    return result.outputs[-1]["data"]["text/plain"]


async def interrupted(session: KernelSession) -> ExecutionStatus:
    running = asyncio.Event()

    async def on_output(output: dict) -> None:
        if "started" in output.get("text", ""):
            running.set()

    task = asyncio.create_task(
        session.execute("import time\nprint('started', flush=True)\ntime.sleep(600)", timeout=120, on_output=on_output)
    )
    await asyncio.wait_for(running.wait(), 60)
    await session.interrupt()
    return (await asyncio.wait_for(task, 60)).status


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.exclusive  # it stops the engine every other test of a parallel run talks to
async def test_sessions_ride_through_a_dockerd_restart():
    if os.geteuid() != 0 or shutil.which("dockerd") is None or (pid := dockerd_pid()) is None:
        pytest.skip(f"needs root and a dockerd to restart (its pid in {dockerd_pidfile()})")
    info = await default_engine().run(default_engine().client.info)
    if info.get("LiveRestoreEnabled") is not True:
        pytest.fail("Docker live-restore is off: run scripts/host-setup.sh as root (it enables it)")
    runtimes = ["runc"]
    if runsc_state() is RunscState.REGISTERED:
        runtimes.append("runsc")
    elif runsc_required():
        pytest.fail("runsc is required but not registered")
    sessions = [
        await KernelSession.start(overrides={"runtime": runtime, "interrupt_grace": 5.0}) for runtime in runtimes
    ]
    try:
        for s in sessions:
            assert await value(s, f"x = 41\nopen('/workspace/kept.txt', 'w').write('{s.id}')\nx") == "41"
        before = {s.id: await asyncio.to_thread(started, s) for s in sessions}

        weighed, _, _ = await asyncio.to_thread(engine_placement)
        await asyncio.to_thread(stop_dockerd, pid)
        try:
            assert not await asyncio.to_thread(docker_answers)
            down_since = time.monotonic()
            rounds = 0
            while time.monotonic() - down_since < DOCKERD_DOWN_SECONDS or rounds < 3:
                for s in sessions:  # ZMQ needs no dockerd: the kernels answer
                    assert await value(s, "x + 1") == "42", s.profile.runtime
                rounds += 1
            with pytest.raises(DockerUnavailableError) as caught:
                await default_engine().run(default_engine().client.api.inspect_container, sessions[0].container.id)
            assert caught.value.http_status == 503
        finally:
            await asyncio.to_thread(start_dockerd, weighed)

        for s in sessions:
            assert await asyncio.to_thread(started, s) == before[s.id], "the container was restarted or replaced"
            assert await value(s, "x") == "41"
            assert await value(s, "open('/workspace/kept.txt').read()") == repr(s.id)
            assert await interrupted(s) is ExecutionStatus.INTERRUPTED, s.profile.runtime
            await s.restart()
            assert await value(s, "'x' in dir()") == "False"  # a restart drops memory state ...
            assert await value(s, "open('/workspace/kept.txt').read()") == repr(s.id)  # ... not the files
    finally:
        for s in sessions:
            await s.shutdown()
