"""Transcripts: recorded from every door, crash-safe, never trusted, replayable and diffable."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest
from nbformat.sign import NotebookNotary

from sandkernel.kernels.durable.store import open_store
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.reaper import reap
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.state_dir import use_state_dir

from .conftest import container_ids_of
from .gateway_fixtures import free_port, running_gateway
from .test_gateway import connect, execute_request, ws_execute

EXAMPLES = Path(__file__).resolve().parents[1] / "notebooks" / "examples"


@pytest.fixture(scope="module")
async def gateway(tmp_path_factory):
    notebooks = tmp_path_factory.mktemp("notebooks")
    async with running_gateway(tmp_path_factory.mktemp("gwn"), notebook_dir=notebooks) as gw:
        yield gw


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.mark.docker
async def test_notebook_records_every_door_in_order(gateway):
    _, session = await gateway.request("POST", "/api/sessions", {"metadata": {"agent": "t"}})
    sid = session["id"]
    try:
        await gateway.request("POST", f"/api/sessions/{sid}/markdown", {"text": "I will add two numbers."})
        await gateway.request(
            "POST", f"/api/sessions/{sid}/execute", {"code": "a = 40\nprint('a set')", "tag": "toolu_1"}
        )
        await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "1/0", "tag": "toolu_2"})
        ws = await connect(gateway, session["kernel"]["id"])
        await ws_execute(ws, "a + 2")
        ws.close()
        await gateway.request("POST", f"/api/sessions/{sid}/restart")
        code, nb_json = await gateway.request("GET", f"/api/sessions/{sid}/notebook")
        assert code == 200
        nb = nbformat.from_dict(nb_json)
        nbformat.validate(nb)
        on_disk = nbformat.read(session["path"], as_version=4)
        assert [c.source for c in on_disk.cells] == [c.source for c in nb.cells]
        kinds = [(c.cell_type, c.source) for c in nb.cells]
        assert kinds[0] == ("markdown", "I will add two numbers.")
        assert [s for t, s in kinds if t == "code"] == ["a = 40\nprint('a set')", "1/0", "a + 2"]
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        assert (
            code_cells[0].outputs[0]["text"] == "a set\n" and code_cells[0].metadata["sandkernel"]["tag"] == "toolu_1"
        )
        assert (
            code_cells[1].metadata["sandkernel"]["status"] == "error"
            and code_cells[1].outputs[0]["ename"] == "ZeroDivisionError"
        )
        assert code_cells[2].metadata["sandkernel"]["source"] == "websocket"
        assert code_cells[2].outputs[0]["data"]["text/plain"] == "42"
        assert [c.execution_count for c in code_cells] == [1, 2, 3]
        assert "restarted on request" in nb.cells[-1].source  # the restart is visible to a reader
        meta = nb.metadata["sandkernel"]
        assert meta["session_id"] == sid and meta["runtime"] == "runc" and meta["image_id"].startswith("sha256:")
        assert nb.metadata["kernelspec"]["name"] == "sandkernel-python"
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")
    assert Path(session["path"]).exists(), "deleting a session keeps its notebook by default"


@pytest.mark.docker
async def test_hostile_html_is_never_trusted(gateway, tmp_path):
    _, session = await gateway.request("POST", "/api/sessions", {})
    sid = session["id"]
    try:
        await gateway.request(
            "POST",
            f"/api/sessions/{sid}/execute",
            {
                "code": "from IPython.display import HTML, Javascript, display\n"
                "display(HTML('<img src=x onerror=\"alert(1)\"><script>alert(2)</script>'))\n"
                "display(Javascript('alert(3)'))"
            },
        )
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}?delete_notebook=1")
    assert not Path(session["path"]).exists(), "delete_notebook=1 removes the transcript"
    # Record another and read the file as a reviewer would.
    _, session = await gateway.request("POST", "/api/sessions", {})
    try:
        await gateway.request(
            "POST",
            f"/api/sessions/{session['id']}/execute",
            {"code": "from IPython.display import HTML\nHTML('<script>alert(1)</script>')"},
        )
        await gateway.request("GET", f"/api/sessions/{session['id']}/notebook")  # flushed to disk
        nb = nbformat.read(session["path"], as_version=4)
        notary = NotebookNotary(data_dir=str(tmp_path))
        assert not notary.check_signature(nb)
        assert "signature" not in nb.metadata
        assert not any(c.metadata.get("trusted") for c in nb.cells)
        assert "text/html" in nb.cells[-1].outputs[0]["data"]  # kept for the reviewer, but inert
    finally:
        await gateway.request("DELETE", f"/api/sessions/{session['id']}")


@pytest.mark.docker
async def test_debug_request_passes_through_the_gateway(gateway):
    _, kernel = await gateway.request("POST", "/api/kernels", {})
    try:
        ws = await connect(gateway, kernel["id"])
        msg = execute_request("")
        msg["header"]["msg_type"] = "debug_request"
        msg["channel"] = "control"
        msg["content"] = {
            "type": "request",
            "seq": 1,
            "command": "initialize",
            "arguments": {"clientID": "sandkernel-test", "adapterID": "python", "pathFormat": "path"},
        }
        await ws.write_message(json.dumps(msg))
        while True:
            data = json.loads(await ws.read_message())
            if data.get("parent_header", {}).get("msg_id") == msg["header"]["msg_id"] and data["channel"] == "control":
                break
        assert data["header"]["msg_type"] == "debug_reply"
        assert data["content"].get("command") == "initialize" and data["content"].get("success") is True
        ws.close()
    finally:
        await gateway.request("DELETE", f"/api/kernels/{kernel['id']}")


@pytest.mark.docker
async def test_sigkill_of_the_gateway_leaves_a_valid_notebook(tmp_path):
    port, token = free_port(), uuid.uuid4().hex + "0123456789"
    notebooks = tmp_path / "nb"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandkernel.cli",
            "serve",
            "--port",
            str(port),
            "--token",
            token,
            "--notebook-dir",
            str(notebooks),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    async def call(method, path, body=None):
        req = HTTPRequest(
            f"http://127.0.0.1:{port}{path}",
            method=method,
            headers={"Authorization": f"token {token}"},
            body=json.dumps(body) if body is not None else None,
            request_timeout=120,
        )
        return json.loads((await AsyncHTTPClient().fetch(req)).body)

    try:
        # Log lines (stderr, merged here) may come first: the audit stream's head, for one.
        seen = []
        while len(seen) < 20 and not any("sandkernel gateway at" in line for line in seen):
            seen.append(proc.stdout.readline())
        assert "sandkernel gateway at" in seen[-1], seen
        session = await call("POST", "/api/sessions", {})
        for i in range(3):
            result = await call("POST", f"/api/sessions/{session['id']}/execute", {"code": f"x{i} = {i}\nprint({i})"})
            assert result["status"] == "ok"
        await call("GET", f"/api/sessions/{session['id']}/notebook")  # returns once the file holds them
        # A fourth execution is running when the gateway dies.
        in_flight = asyncio.create_task(
            call("POST", f"/api/sessions/{session['id']}/execute", {"code": "import time\ntime.sleep(600)"})
        )
        await asyncio.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with pytest.raises(Exception):  # noqa: B017 - the connection dies with the gateway
        await in_flight
    nb = nbformat.read(session["path"], as_version=4)
    nbformat.validate(nb)
    assert [c.source for c in nb.cells if c.cell_type == "code"] == [f"x{i} = {i}\nprint({i})" for i in range(3)]
    assert not list(notebooks.glob(".*.tmp")), "no temp file left behind"
    # The container outlived its gateway, recorded for the next one: the reaper spares it, and
    # its record is what clears it.
    assert container_ids_of(session["id"])
    await reap(default_engine())
    assert container_ids_of(session["id"])
    store = open_store(tmp_path / "state" / "catalog.sqlite3")
    records = await store.load()
    await store.close()
    assert session["id"] in {record.session_id for record in records}
    previous = use_state_dir(tmp_path / "state")  # where their workspace disks are
    try:
        for record in records:  # the session, and the warm pool's sandboxes
            await KernelSession.discard(record.session_id, record.kernel)
            assert container_ids_of(record.session_id) == []
        await reap(default_engine())  # a refill the kill cut short was never recorded: its disk is swept
    finally:
        use_state_dir(previous)
    assert not list((tmp_path / "state" / "workspaces").glob("*.img"))


@pytest.mark.docker
@pytest.mark.parametrize("name", ["sales-demo.ipynb", "error-recovery.ipynb"])
def test_examples_replay_the_same(tmp_path, name):
    """Through the CLI with no --runtime: the transcript's own (runc) is used."""
    copy = tmp_path / name
    shutil.copy(EXAMPLES / name, copy)
    proc = run_cli("replay", str(copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = len([c for c in nbformat.read(copy, as_version=4).cells if c.cell_type == "code"])
    assert f"{cells} of {cells} code cells the same" in proc.stdout and "changed" not in proc.stdout
    assert "Could not destroy zmq context" not in proc.stderr, proc.stderr
    replayed = nbformat.read(tmp_path / name.replace(".ipynb", ".replay.ipynb"), as_version=4)
    nbformat.validate(replayed)
    assert replayed.metadata.sandkernel.runtime == "runc"
    assert [c.metadata["sandkernel"]["replay_verdict"] for c in replayed.cells if c.cell_type == "code"] == [
        "same"
    ] * cells


@pytest.mark.docker
def test_a_changed_cell_is_reported_with_a_diff(tmp_path):
    nb = nbformat.read(EXAMPLES / "error-recovery.ipynb", as_version=4)
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    stream = next(o for o in last.outputs if o["output_type"] == "stream")
    stream["text"] = stream["text"].replace("total:", "grand total:")
    path = tmp_path / "edited.ipynb"
    nbformat.write(nb, path)
    proc = run_cli("replay", str(path), "--until", "4", "--runtime", "runc")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cell 4: changed" in proc.stdout and "-grand total:" in proc.stdout and "+total:" in proc.stdout
    assert "cell 1: same" in proc.stdout and "3 of 4 code cells the same (1 changed)" in proc.stdout
    diff = run_cli("diff", str(EXAMPLES / "error-recovery.ipynb"), str(path))
    assert diff.returncode == 1 and "cell 4: changed" in diff.stdout
    same = run_cli("diff", str(EXAMPLES / "error-recovery.ipynb"), str(EXAMPLES / "error-recovery.ipynb"))
    assert same.returncode == 0 and "4 of 4 code cells the same" in same.stdout


def test_bad_notebook_paths_get_clear_errors(tmp_path):
    proc = run_cli("replay", str(tmp_path / "missing.ipynb"))
    assert proc.returncode == 2 and "no notebook at" in proc.stderr
    assert os.path.exists(EXAMPLES / "sales-demo.ipynb")
    garbage = tmp_path / "garbage.ipynb"
    garbage.write_text("{not json")
    proc = run_cli("replay", str(garbage))
    assert proc.returncode == 2 and "is not a notebook nbformat can read" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "garbage.replay.ipynb").exists()


@pytest.mark.docker
def test_replay_restores_uploads_and_asks_for_files_too_large_to_embed(tmp_path):
    from sandkernel.agent.scenarios import make_sales_files

    nb = nbformat.read(EXAMPLES / "sales-demo.ipynb", as_version=4)
    [entry] = nb.metadata["sandkernel"]["inputs"]
    assert entry["path"] == "sales.csv" and entry["before_cell"] == 0 and "base64" in entry
    del entry["base64"]  # as for an upload over the embedding limit
    path = tmp_path / "big-input.ipynb"
    nbformat.write(nb, path)
    proc = run_cli("replay", str(path), "--runtime", "runc")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "needs the file sales.csv" in proc.stderr and "pass it with --file" in proc.stderr
    [csv_path] = make_sales_files(tmp_path)
    proc = run_cli("replay", str(path), "--file", str(csv_path), "--runtime", "runc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 of 3 code cells the same" in proc.stdout
