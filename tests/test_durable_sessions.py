"""Durable sessions (issue 13): a session's sandbox outlives the gateway process.

Every test runs real ``sandkernel serve`` processes (their own ``--state-dir`` and notebook dir
under tmp_path) and talks to them over HTTP as clients do. Each ends by starting the gateway with
``--on-exit delete`` and stopping it (SIGTERM), which removes every sandbox the catalog holds,
lost ones included, and then asserts that no container of its sessions is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import http.client
import json
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import nbformat
import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

from sandkernel.kernels.sandbox.docker_engine import default_engine

from .conftest import RUNC, RUNSC, RUNTIME_PARAMS, container_ids_of, require_runtime
from .gateway_fixtures import ALICE, BOB, OPERATOR, call_api, free_port

pytestmark = pytest.mark.docker

START_TIMEOUT = 180.0


class Serve:
    """One ``sandkernel serve`` subprocess on a state dir that outlives it (the test's)."""

    def __init__(self, tmp_path: Path, runtime: str) -> None:
        self.runtime = runtime
        self.state = tmp_path / "state"
        self.notebooks = tmp_path / "notebooks"
        self.tokens = tmp_path / "tokens.json"
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tokens.write_text(json.dumps({"alice": ALICE, "bob": BOB}))
        self.tokens.chmod(0o600)
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "sandkernel.cli", "--log-level", "INFO", "serve",
            "--port", str(self.port), "--tokens-file", str(self.tokens), "--state-dir", str(self.state),
            "--notebook-dir", str(self.notebooks), "--pool-size", "0", "--default-runtime", self.runtime,
            "--max-sessions", "12", "--metrics-token", OPERATOR, *extra,
        ]  # fmt: skip

    def launch(self, *extra: str) -> subprocess.Popen[str]:
        self.lines = []
        proc = subprocess.Popen(self.argv(*extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.proc = proc

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        return proc

    async def start(self, *extra: str) -> Serve:
        """Start and wait until it listens (it adopts the catalog before that)."""
        proc = self.launch(*extra)
        deadline = time.monotonic() + START_TIMEOUT
        while not any("sandkernel gateway at" in line for line in self.lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("the gateway did not start:\n" + self.output)
            await asyncio.sleep(0.05)
        return self

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    async def term(self, timeout: float = 120.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            raise AssertionError("the gateway did not stop on SIGTERM:\n" + self.output)
        return self.proc.returncode

    async def call(self, method: str, path: str, body: Any = None, token: str = ALICE) -> tuple[int, Any]:
        status, data, _ = await call_api(self.url + path, method, body, token)
        return status, data

    async def execute(self, sid: str, code: str, token: str = ALICE, timeout: float = 120) -> dict[str, Any]:
        status, result = await self.call(
            "POST", f"/api/sessions/{sid}/execute", {"code": code, "timeout": timeout}, token
        )
        assert status == 200, (status, result, self.output[-4000:])
        return result

    async def create(self, token: str = ALICE, **body: Any) -> dict[str, Any]:
        status, model = await self.call("POST", "/api/sessions", body, token)
        assert status == 201, (status, model)
        return model

    async def recorded_running(self, sid: str, timeout: float = 60) -> None:
        """Until the catalog records an execution in flight for ``sid`` (what the next gateway
        settles): the event a kill must come after, whatever the machine's load."""
        catalog = f"file:{self.state / 'catalog.sqlite3'}?mode=ro"
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.closing(sqlite3.connect(catalog, uri=True)) as db:
                    row = db.execute("SELECT running FROM sandboxes WHERE session_id = ?", (sid,)).fetchone()
                if row is not None and row[0] is not None:
                    return
                await asyncio.sleep(0.05)

    async def upload(self, sid: str, path: str, data: bytes = b"", token: str = ALICE) -> None:
        status, body, _ = await call_api(f"{self.url}/api/sessions/{sid}/files/{path}", "PUT", token=token, raw=data)
        assert status in (200, 201), (status, body)

    async def flushed(self, sid: str, token: str = ALICE) -> None:
        """Returns once the session's transcript file holds every cell recorded so far."""
        status, _ = await self.call("GET", f"/api/sessions/{sid}/notebook", token=token)
        assert status == 200


def gated(before: str, after: str) -> str:
    """A cell that runs ``before``, then waits (up to 300 s) until the test uploads 'release',
    then runs ``after``: still running whenever the test needs it to be, however loaded the machine."""
    wait = "while not pathlib.Path('release').exists() and time.monotonic() < deadline:\n    time.sleep(0.1)\n"
    return f"import pathlib, time\n{before}\ndeadline = time.monotonic() + 300\n{wait}{after}"


async def clean_up(serve: Serve, session_ids: list[str]) -> None:
    """Start a gateway on the test's state dir with --on-exit delete and stop it: every recorded
    sandbox (adopted or lost) is removed. Then nothing of the test may be left."""
    if serve.proc is not None and serve.proc.poll() is None:
        serve.kill9()
    serve.port = free_port()
    await serve.start("--on-exit", "delete")
    assert await serve.term() == 0, serve.output
    left = {sid: container_ids_of(sid) for sid in session_ids}
    assert not any(left.values()), f"containers left behind: {left}"


def reap_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", "reap", *args], capture_output=True, text=True, timeout=120
    )


def code_cells(path: str) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return [cell.source for cell in nb.cells if cell.cell_type == "code"]


def markdown_text(path: str) -> str:
    nb = nbformat.read(path, as_version=4)
    return "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")


def make_wheel(directory: Path, name: str = "sk_durable_pkg") -> None:
    """A minimal pure-Python wheel (as tests/test_execute.py makes one)."""
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": "ANSWER = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sandkernel-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{name}-1.0-py3-none-any.whl", "w") as zf:
        for n, text in files.items():
            zf.writestr(n, text)


def profiles_with_wheelhouse(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels)
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"default": {"wheelhouse": str(wheels)}}))
    return profiles


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_kill9_with_ten_live_sessions_every_session_carries_on(tmp_path, runtime):
    require_runtime(runtime)
    serve = Serve(tmp_path, runtime)
    profiles = profiles_with_wheelhouse(tmp_path)
    await serve.start("--profiles", str(profiles))
    ids: list[str] = []
    try:
        sessions = await asyncio.gather(*(serve.create(metadata={"name": f"s{i}"}) for i in range(10)))
        ids = [s["id"] for s in sessions]
        kernels = {s["id"]: s["kernel"]["id"] for s in sessions}

        async def prepare(i: int, sid: str) -> None:
            result = await serve.execute(sid, f"x = {i} * 1000\nprint('set', x)")
            assert result["status"] == "ok", result
            status, _ = await serve.call("PUT", f"/api/sessions/{sid}/files/notes-{i}.txt", None)
            assert status in (200, 201)
            written = await serve.execute(sid, f"open('/workspace/data-{i}.txt', 'w').write('file {i}')")
            assert written["status"] == "ok", written

        await asyncio.gather(*(prepare(i, sid) for i, sid in enumerate(ids)))
        pip = await serve.execute(ids[0], "%pip install -q sk_durable_pkg", timeout=180)
        assert pip["status"] == "ok", pip
        figure = await serve.execute(
            ids[1],
            "import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots()\nax.plot([1, 2, 3], [3, 1, 2])\nprint('pending')",
        )
        assert figure["status"] == "ok" and figure["text"] == "pending\n", figure
        for sid in ids:
            await serve.flushed(sid)
        before = {sid: code_cells(s["path"]) for sid, s in zip(ids, sessions, strict=True)}
        serve.kill9()

        started = time.monotonic()
        await serve.start()
        took = time.monotonic() - started
        assert "adopted 10 session(s), 0 paused, 0 lost" in serve.output, serve.output
        status, listed = await serve.call("GET", "/api/sessions")
        assert status == 200 and sorted(m["id"] for m in listed) == sorted(ids)
        assert all(m["state"] == "running" and "lost_reason" not in m for m in listed)
        assert {m["id"]: m["kernel"]["id"] for m in listed} == kernels  # JupyterLab reconnects by kernel id
        assert {m["id"]: m["name"] for m in listed} == {sid: f"s{i}" for i, sid in enumerate(ids)}

        async def check(i: int, sid: str) -> None:
            result = await serve.execute(sid, f"print(x, open('/workspace/data-{i}.txt').read())")
            assert result["status"] == "ok" and result["text"] == f"{i * 1000} file {i}\n", result
            assert not result.get("state_lost"), result

        await asyncio.gather(*(check(i, sid) for i, sid in enumerate(ids)))
        installed = await serve.execute(ids[0], "import sk_durable_pkg; print(sk_durable_pkg.ANSWER)")
        assert installed["text"] == "42\n", installed
        shown = await serve.execute(
            ids[1],
            "import io\nfrom IPython.display import Image, display\nbuf = io.BytesIO()\n"
            "fig.savefig(buf, format='png')\nprint(len(ax.lines))\ndisplay(Image(buf.getvalue()))",
        )
        assert shown["status"] == "ok" and shown["text"].startswith("1\n"), shown
        assert any("image/png" in o.get("data", {}) for o in shown["outputs"]), shown["outputs"]
        for i, sid in enumerate(ids):
            await serve.flushed(sid)
            path = sessions[i]["path"]
            cells = code_cells(path)  # the same file, continued
            assert cells[: len(before[sid])] == before[sid], (sid, cells)
            assert cells[len(before[sid])] == f"print(x, open('/workspace/data-{i}.txt').read())"
            assert "gateway restarted" in markdown_text(path)
        print(f"re-adoption of 10 {runtime} sessions: gateway up in {took:.2f}s")
    finally:
        await clean_up(serve, ids)


@pytest.mark.parametrize("runtime", [RUNC])
async def test_kill9_during_a_running_cell_its_end_is_recorded_by_the_next_gateway(tmp_path, runtime):
    serve = Serve(tmp_path, runtime)
    await serve.start()
    ids: list[str] = []
    try:
        session = await serve.create()
        sid = session["id"]
        ids.append(sid)
        # The cell ends only when the test says so, after the next gateway is up: how long a
        # gateway takes to start on a loaded host must not decide whether its end is watched.
        code = (
            "import os, time\nprint('before', flush=True)\n"
            "while not os.path.exists('/tmp/go'):\n    time.sleep(0.1)\ny = 7\nprint('after')"
        )
        in_flight = asyncio.create_task(serve.execute(sid, code))
        await asyncio.sleep(2.0)  # the cell runs, and the catalog says so
        serve.kill9()
        with pytest.raises(Exception):  # noqa: B017 - its connection dies with the gateway
            await in_flight
        await serve.start()
        (container,) = container_ids_of(sid)
        subprocess.run(["docker", "exec", container, "touch", "/tmp/go"], check=True, timeout=60)
        # The next execute queues behind the cell left running, which the new gateway settles.
        result = await serve.execute(sid, "print(y)")
        assert result["status"] == "ok" and result["text"] == "7\n", result
        await serve.flushed(sid)
        nb = nbformat.read(session["path"], as_version=4)
        cells = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.source for c in cells] == [code, "print(y)"]
        assert "after" in json.dumps(cells[0].outputs)  # its output after the restart was collected
    finally:
        await clean_up(serve, ids)


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_sigterm_during_a_running_cell_detaches_it_and_the_next_gateway_records_its_end(tmp_path, runtime):
    require_runtime(runtime)
    serve = Serve(tmp_path, runtime)
    await serve.start("--shutdown-grace", "2")
    ids: list[str] = []
    try:
        busy, other = await asyncio.gather(serve.create(), serve.create())
        ids += [busy["id"], other["id"]]
        code = gated("print('started', flush=True)", "z = 2\nprint('finished')")
        kept_alive = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)  # a client's open connection
        headers = {"Authorization": f"token {ALICE}", "Content-Type": "application/json"}
        assert (await asyncio.to_thread(request_on, kept_alive, "GET", "/api/sessions", None, headers))[0] == 200
        ws_url = serve.url.replace("http", "ws") + f"/api/kernels/{other['kernel']['id']}/channels"
        ws = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {ALICE}"}))
        in_flight = asyncio.create_task(serve.execute(busy["id"], code))
        await serve.recorded_running(busy["id"])  # (its 'started' reaches the gateway within the grace)
        stopped = asyncio.create_task(serve.term())
        await asyncio.sleep(0.5)  # inside the grace: no new connections; new work on open ones is refused
        with pytest.raises(ConnectionRefusedError):
            await serve.call("GET", "/api/sessions")
        status, retry_after, refused = await asyncio.to_thread(
            request_on, kept_alive, "POST", f"/api/sessions/{other['id']}/execute", b'{"code": "1"}', headers
        )
        assert status == 503 and refused["error"] == "gateway_restarting" and retry_after, refused
        assert "restarting" in refused["message"] and "retry" in refused["message"]
        result = await in_flight
        assert result["status"] == "detached" and result["ended_by"] == "gateway_restart", result
        assert "started" in result["text"]
        assert await stopped == 0, serve.output
        while await ws.read_message() is not None:  # JupyterLab reconnects after "service restart"
            pass
        assert ws.close_code == 1012, ws.close_code
        assert container_ids_of(busy["id"]) and container_ids_of(other["id"])  # left running

        await serve.start()
        await serve.upload(busy["id"], "release")  # the cell ends now, watched by this gateway
        after = await serve.execute(busy["id"], "print(z)")  # behind the cell, settled by this gateway
        assert after["status"] == "ok" and after["text"] == "2\n", after
        await serve.flushed(busy["id"])
        # The cell as its caller got it (detached, the output so far), then its end, recorded by
        # the gateway that adopted it (same start time, the output it printed after the restart).
        nb = nbformat.read(busy["path"], as_version=4)
        cut, settled, last = (c for c in nb.cells if c.cell_type == "code")
        assert (cut.source, settled.source, last.source) == (code, code, "print(z)")
        assert (cut.metadata.sandkernel.status, cut.metadata.sandkernel.ended_by) == ("detached", "gateway_restart")
        assert settled.metadata.sandkernel.status == "ok"
        # (its start as the catalog recorded it: the very timestamp taken as the request was sent)
        assert settled.metadata.sandkernel.started_at == cut.metadata.sandkernel.started_at
        assert "started" in json.dumps(cut.outputs) and "finished" in json.dumps(settled.outputs)
        text = markdown_text(busy["path"])
        assert "gateway stopped" in text and "gateway restarted" in text
    finally:
        await clean_up(serve, ids)


def request_on(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, str | None, Any]:
    """One request on an open (keep-alive) connection: status, Retry-After, JSON body."""
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, response.getheader("Retry-After"), json.loads(response.read() or b"null")


def container_state(sid: str) -> dict[str, Any]:
    engine = default_engine()
    [container_id] = container_ids_of(sid)
    return engine.client.api.inspect_container(container_id)["State"]


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_a_restart_lists_dead_sandboxes_as_lost_with_the_reason(tmp_path, runtime):
    """runsc: an OOM kill takes the whole sandbox down (under runc only the kernel dies, and the
    adopted session restarts it, saying so). Docker ``rm -f`` of another. Both are lost, the
    third is adopted, and the lost ones answer 410 until they are deleted."""
    require_runtime(runtime)
    serve = Serve(tmp_path, runtime)
    await serve.start()
    ids: list[str] = []
    try:
        oom, removed, kept = await asyncio.gather(
            serve.create(limits={"memory_mb": 256}), serve.create(), serve.create()
        )
        ids += [oom["id"], removed["id"], kept["id"]]
        assert (await serve.execute(kept["id"], "k = 'kept'"))["status"] == "ok"
        hog = "import time\ntime.sleep(2)\nblocks = []\nwhile True:\n    blocks.append(bytearray(2**24))"
        in_flight = asyncio.create_task(serve.execute(oom["id"], hog))
        await serve.recorded_running(oom["id"])  # the hog reached the kernel: it runs on alone
        serve.kill9()
        with contextlib.suppress(Exception):
            await in_flight
        for _ in range(300):  # the sandbox dies of memory with no gateway attached
            if not container_state(oom["id"])["Running"]:
                break
            await asyncio.sleep(0.1)
        # Killed: Docker's OOMKilled, or a SIGKILL's exit when the shim sent its OOM event after
        # the exit (Docker then never sets the flag; the gateway reads the engine's event log).
        stopped = container_state(oom["id"])
        assert not stopped["Running"] and (stopped["OOMKilled"] or stopped["ExitCode"] == 137), stopped
        subprocess.run(["docker", "rm", "-f", *container_ids_of(removed["id"])], check=True, capture_output=True)

        await serve.start()
        assert "adopted 1 session(s), 0 paused, 2 lost" in serve.output, serve.output
        status, listed = await serve.call("GET", "/api/sessions")
        models = {m["id"]: m for m in listed}
        assert models[kept["id"]]["state"] == "running"
        reason = models[oom["id"]]["lost_reason"]
        assert models[oom["id"]]["state"] == "lost" and "killed" in reason and "memory" in reason, reason
        assert models[removed["id"]]["state"] == "lost" and "removed" in models[removed["id"]]["lost_reason"]
        status, one = await serve.call("GET", f"/api/sessions/{oom['id']}")
        assert status == 200 and one["state"] == "lost" and one["kernel"]["execution_state"] == "dead"
        for path, body in (
            (f"/api/sessions/{oom['id']}/execute", {"code": "1"}),
            (f"/api/sessions/{oom['id']}/restart", None),
        ):
            status, error = await serve.call("POST", path, body)
            assert status == 410 and error["error"] == "sandbox_lost" and "delete it" in error["message"], error
        status, error = await serve.call("GET", f"/api/sessions/{removed['id']}/files")
        assert status == 410 and error["error"] == "sandbox_lost"
        status, transcript = await serve.call("GET", f"/api/sessions/{oom['id']}/notebook")  # what is left
        assert status == 200 and transcript["metadata"]["sandkernel"]["session_id"] == oom["id"], transcript
        status, kernels = await serve.call("GET", "/api/kernels")
        assert [k["id"] for k in kernels] == [kept["kernel"]["id"]]  # JupyterLab sees only live kernels
        assert (await serve.execute(kept["id"], "print(k)"))["text"] == "kept\n"

        status, _ = await serve.call("DELETE", f"/api/sessions/{oom['id']}")
        assert status == 204
        assert (await serve.call("GET", f"/api/sessions/{oom['id']}"))[0] == 404
        assert container_ids_of(oom["id"]) == [] and Path(oom["path"]).exists()  # the transcript is kept
        await serve.term()
        await serve.start()  # the deleted one is gone from the catalog; the other lost one stays listed
        status, listed = await serve.call("GET", "/api/sessions")
        assert {m["id"]: m["state"] for m in listed} == {removed["id"]: "lost", kept["id"]: "running"}
    finally:
        await clean_up(serve, ids)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("runtime", [RUNC])
@pytest.mark.parametrize("damage", ["corrupt", "newer"])
async def test_an_unusable_catalog_stops_the_gateway_and_nothing_is_touched(tmp_path, runtime, damage):
    serve = Serve(tmp_path, runtime)
    await serve.start()
    ids: list[str] = []
    catalog = serve.state / "catalog.sqlite3"
    saved = b""
    try:
        session = await serve.create()
        ids.append(session["id"])
        await serve.term()  # detached: the container runs on, recorded
        saved = catalog.read_bytes()
        if damage == "corrupt":
            catalog.write_bytes(b"\x00not a database\x00" * 64 + saved[1024:])
        else:
            with contextlib.closing(sqlite3.connect(catalog)) as db, db:
                db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        before = {p.name: digest(p) for p in serve.state.iterdir() if p.is_file()}
        proc = serve.launch()
        assert proc.wait(120) != 0
        await asyncio.sleep(0.2)  # the reader thread has the last lines
        message = serve.output
        assert str(catalog) in message and "Nothing was changed or deleted" in message, message
        assert ("damaged" if damage == "corrupt" else "schema version 99") in message, message
        assert "Traceback" not in message
        assert {p.name: digest(p) for p in serve.state.iterdir() if p.is_file()} == before
        assert container_state(session["id"])["Running"]  # the sandbox was left alone
        reaped = reap_cli("--state-dir", str(serve.state))  # cannot tell what is recorded: removes nothing
        assert reaped.returncode != 0 and "nothing was changed" in reaped.stderr.lower(), reaped
        assert container_state(session["id"])["Running"]
    finally:
        if saved:
            catalog.write_bytes(saved)
        await clean_up(serve, ids)


@pytest.mark.parametrize("runtime", [RUNC])
async def test_tenants_cannot_see_or_reach_each_others_adopted_sessions(tmp_path, runtime):
    serve = Serve(tmp_path, runtime)
    await serve.start()
    ids: list[str] = []
    try:
        alice, bob = await asyncio.gather(serve.create(ALICE), serve.create(BOB))
        ids += [alice["id"], bob["id"]]
        assert (await serve.execute(bob["id"], "secret = 'bob'", BOB))["status"] == "ok"
        serve.kill9()
        # Their owner is dead, but they are recorded for the next gateway: `sandkernel reap` keeps them.
        reaped = reap_cli("--state-dir", str(serve.state))
        assert reaped.returncode == 0 and container_ids_of(alice["id"]) and container_ids_of(bob["id"]), reaped.stdout
        await serve.start()
        for token, mine, theirs in ((ALICE, alice, bob), (BOB, bob, alice)):
            status, listed = await serve.call("GET", "/api/sessions", token=token)
            assert [m["id"] for m in listed] == [mine["id"]]
            status, kernels = await serve.call("GET", "/api/kernels", token=token)
            assert [k["id"] for k in kernels] == [mine["kernel"]["id"]]
            for method, path, body in (
                ("GET", f"/api/sessions/{theirs['id']}", None),
                ("POST", f"/api/sessions/{theirs['id']}/execute", {"code": "print(secret)"}),
                ("GET", f"/api/sessions/{theirs['id']}/notebook", None),
                ("GET", f"/api/kernels/{theirs['kernel']['id']}", None),
                ("DELETE", f"/api/sessions/{theirs['id']}", None),
            ):
                status, _ = await serve.call(method, path, body, token)
                assert status == 404, (token, method, path, status)
            url = serve.url.replace("http", "ws") + f"/api/kernels/{theirs['kernel']['id']}/channels"
            with pytest.raises(HTTPClientError) as refused:
                await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}))
            assert refused.value.code == 404
        assert (await serve.execute(bob["id"], "print(secret)", BOB))["text"] == "bob\n"
    finally:
        await clean_up(serve, ids)


def catalogued(serve: Serve, kind: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(f"file:{serve.state / 'catalog.sqlite3'}?mode=ro", uri=True)) as db:
        return [row[0] for row in db.execute("SELECT session_id FROM sandboxes WHERE kind = ?", (kind,))]


async def warm_pool_size(serve: Serve, size: int) -> None:
    for _ in range(1200):
        status, health = await serve.call("GET", "/api/health")
        if status == 200 and health["warm_pool"] >= size:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the warm pool never held {size}:\n{serve.output}")


@pytest.mark.parametrize("runtime", [RUNC])
async def test_warm_pool_sandboxes_are_adopted_back_into_the_pool_or_removed(tmp_path, runtime):
    """Nothing unaccounted: a pooled sandbox outlives a restart in the catalog (kind pool), goes
    back into the pool of a gateway whose pool takes it, and is removed by one whose pool does not."""
    serve = Serve(tmp_path, runtime)
    await serve.start("--pool-size", "1")
    ids: list[str] = []
    try:
        await warm_pool_size(serve, 1)
        [pooled] = catalogued(serve, "pool")
        ids.append(pooled)
        assert await serve.term() == 0
        assert container_ids_of(pooled)  # left running, recorded

        await serve.start("--pool-size", "1", "--pool-max", "1")  # no growth with demand: one pooled sandbox
        assert "1 pooled sandbox(es) back in the pool" in serve.output, serve.output
        session = await serve.create()  # served from the adopted sandbox: no container started for it
        assert session["id"] == pooled
        assert catalogued(serve, "session") == [pooled]
        await warm_pool_size(serve, 1)  # refilled with a new one
        [refill] = catalogued(serve, "pool")
        ids.append(refill)
        assert await serve.term() == 0

        await serve.start("--pool-size", "0")
        assert "adopted 1 session(s)" in serve.output and "1 discarded" in serve.output, serve.output
        assert container_ids_of(refill) == [] and catalogued(serve, "pool") == []
        assert (await serve.execute(pooled, "print('still here')"))["text"] == "still here\n"
    finally:
        await clean_up(serve, ids)


@pytest.mark.parametrize("runtime", [RUNC])
async def test_an_adopted_session_keeps_its_idle_clock(tmp_path, runtime):
    """Idle 17 s of a 20 s idle timeout before the restart: culled about 3 s after its adoption
    (a fresh clock would give it 20). Both instants are the gateway's own, from its log, so a
    slow start on a loaded machine (which only makes the kept clock run out sooner after the
    adoption) cannot fail the test; a loop stalled for seconds by a CPU hog (7.8 s seen, with
    the first sweeps after a start) has 8.5 s of room, and a fresh clock is still 8 s past it."""
    serve = Serve(tmp_path, runtime)
    idle_timeout, idle_before = 20.0, 17.0
    options = ("--idle-timeout", f"{idle_timeout:g}", "--cull-interval", "0.5", "--idle-action", "delete")
    await serve.start(*options)
    ids: list[str] = []
    try:
        session = await serve.create()
        ids.append(session["id"])
        assert (await serve.execute(session["id"], "1"))["status"] == "ok"  # the last activity
        await asyncio.sleep(idle_before)
        serve.kill9()
        await serve.start(*options)
        assert "adopted 1 session(s)" in serve.output, serve.output
        deadline = time.monotonic() + 3 * idle_timeout  # culled by then, kept clock or fresh
        while (await serve.call("GET", f"/api/sessions/{session['id']}"))[0] == 200:
            assert time.monotonic() < deadline, "the adopted session was never culled"
            await asyncio.sleep(0.2)
        adopted = logged_at(serve.output, r"adopted 1 session\(s\)")
        culled = logged_at(serve.output, rf"culling session.* session={session['id']}")
        # Kept: at most (idle_timeout - idle_before) plus a cull interval after the adoption; a
        # fresh clock: idle_timeout after it. The bound sits between the two.
        assert (culled - adopted).total_seconds() < idle_timeout - idle_before + 9, (adopted, culled)
        for _ in range(300):  # culled: its container is being removed
            if not container_ids_of(session["id"]):
                break
            await asyncio.sleep(0.1)
        assert container_ids_of(session["id"]) == []
    finally:
        await clean_up(serve, ids)


def logged_at(output: str, pattern: str) -> dt.datetime:
    """When the gateway logged its last line matching ``pattern`` (its text log's asctime)."""
    found = re.findall(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*{pattern}", output, re.MULTILINE)
    assert found, f"no log line matches {pattern!r}:\n{output[-3000:]}"
    return dt.datetime.strptime(found[-1], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.parametrize("runtime", [RUNC])
async def test_a_gateway_on_another_state_dir_does_not_reap_recorded_sandboxes(tmp_path, runtime):
    """After a crash, a sandbox's owner label names a dead process; a gateway (or `sandkernel
    agent`'s local one) started on another state dir must leave it to the catalog that holds it."""
    first = Serve(tmp_path / "first", runtime)
    other = Serve(tmp_path / "other", runtime)
    await first.start()
    ids: list[str] = []
    try:
        session = await first.create()
        ids.append(session["id"])
        assert (await first.execute(session["id"], "kept = 1"))["status"] == "ok"
        first.kill9()
        await other.start()  # reaps the orphans of ITS state dir at start
        assert container_ids_of(session["id"]), "another state dir's gateway reaped a recorded sandbox"
        assert await other.term() == 0
        await first.start()
        assert (await first.execute(session["id"], "print(kept)"))["text"] == "1\n"
    finally:
        await clean_up(first, ids)


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_websocket_cell_cut_off_by_a_restart_gets_its_reply_when_its_client_reconnects(tmp_path, runtime):
    """JupyterLab marks a cell done on its execute_reply, which the kernel sent to the dead
    gateway's socket: the next gateway answers it once the settled cell ends."""
    require_runtime(runtime)
    serve = Serve(tmp_path, runtime)
    await serve.start()
    ids: list[str] = []
    try:
        session = await serve.create()
        ids.append(session["id"])
        url = serve.url.replace("http", "ws") + f"/api/kernels/{session['kernel']['id']}/channels"
        connect = HTTPRequest(url, headers={"Authorization": f"token {ALICE}"})
        ws = await websocket_connect(connect)
        msg_id = "lab-" + dt.datetime.now().strftime("%H%M%S%f")
        request = {
            "header": {
                "msg_id": msg_id,
                "msg_type": "execute_request",
                "session": "lab",
                "username": "u",
                "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                "version": "5.3",
            },
            "parent_header": {},
            "metadata": {},
            "channel": "shell",
            "buffers": [],
            "content": {
                # Still running when the next gateway has adopted it: it ends when released.
                "code": gated("", "cut_off = 1"),
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        }
        await ws.write_message(json.dumps(request))
        await serve.recorded_running(session["id"])  # running, and recorded as such
        serve.kill9()
        await serve.start()
        ws = await websocket_connect(connect)  # the client reconnects, as jupyter_server does
        await serve.upload(session["id"], "release")
        deadline = time.monotonic() + 60
        reply = None
        while reply is None and time.monotonic() < deadline:
            frame = await asyncio.wait_for(ws.read_message(), deadline - time.monotonic())
            message = json.loads(frame)
            if message.get("parent_header", {}).get("msg_id") == msg_id and message["channel"] == "shell":
                reply = message
        assert reply is not None, "no execute_reply reached the reconnected client"
        assert reply["header"]["msg_type"] == "execute_reply" and reply["content"]["status"] == "ok", reply
        ws.close()
        # The cell really ran to its end in the kernel (the reply says so; its variable is there).
        code, variables = await serve.call("GET", f"/api/sessions/{session['id']}/variables")
        assert code == 200 and "cut_off" in {v["name"] for v in variables}, variables
    finally:
        await clean_up(serve, ids)
