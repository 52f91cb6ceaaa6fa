"""A replay says what it does twice (issue 33, step 5): cells that reached beyond the sandbox
when they first ran (an HTTP request through the egress proxy, a shell command, a package
install) are reported per cell in ``side_effects``, and refused when the operator says so.

The replay is runc's resume (no memory checkpoint there). The upstream is a server this test
starts on loopback, reached only through the session's egress proxy.
"""

from __future__ import annotations

import asyncio

import nbformat
import pytest

from sandkernel.errors import ReplayRefusedError
from sandkernel.kernels.egress.policy import EgressPolicy
from sandkernel.notebooks.resume import rebuild
from sandkernel.notebooks.side_effects import side_effects_of
from sandkernel.notebooks.transcript import build_notebook

from .conftest import container_ids_of
from .gateway_fixtures import start_gateway, stop_gateway
from .test_egress import Upstream, policy_for


def code_cell(source: str, egress: dict | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["sandkernel"] = {"accounting": {"egress": egress}}
    return cell


def test_what_each_recorded_cell_did_beyond_the_sandbox():
    notebook = build_notebook(
        [
            code_cell("x = 1"),
            code_cell("import urllib.request\nurllib.request.urlopen(url)", {"allowed": 1, "refused": 0, "failed": 0}),
            code_cell("!curl -s example.test"),
            code_cell("%%bash\necho hi"),
            code_cell("import subprocess as sp\nsp.run(['ls'])"),
            code_cell("%pip install -q pkg"),
            code_cell("urllib.request.urlopen(url)", {"allowed": 0, "refused": 1, "failed": 0}),  # sent, refused
            code_cell("def f(:"),  # does not parse: nothing ran
        ],
        {},
    )
    assert side_effects_of(notebook, range(1, 10)) == {
        2: ["network"],
        3: ["shell"],
        4: ["shell"],
        5: ["shell"],
        6: ["packages"],
        7: ["network"],
    }
    assert side_effects_of(notebook, [1, 8]) == {}  # only the cells asked about, and only those that reached out


async def test_reading_a_long_sessions_cells_before_a_replay_leaves_the_event_loop_free():
    """Issue 30, item 3: every cell to re-run is parsed through IPython's transformer (about
    0.2 ms each) before a replay; that ran on the gateway's event loop, holding every tenant's
    requests for the whole read (seconds for a long session). It now runs in a thread: the loop
    keeps turning meanwhile. The last cell runs a shell command, so a refusing rebuild stops
    right after the read, before it touches any session (none is given)."""
    cells = [code_cell(f"x = {n}\nfor i in range(3):\n    x += i") for n in range(5_000)] + [code_cell("!ls")]
    notebook = build_notebook(cells, {})
    turns, reading = 0, True

    async def turn_the_loop() -> None:
        nonlocal turns
        while reading:
            await asyncio.sleep(0)
            turns += 1

    turner = asyncio.create_task(turn_the_loop())
    await asyncio.sleep(0)
    before = turns
    try:
        with pytest.raises(ReplayRefusedError, match=r"cell 5001: shell"):
            await rebuild(None, notebook, cells=list(range(1, len(cells) + 1)), refuse_side_effects=True)  # type: ignore[arg-type]
    finally:
        reading = False
        await turner
    assert turns - before > 100, f"the event loop turned {turns - before} times while 5,001 cells were read"


@pytest.mark.docker
async def test_a_replay_reports_the_request_it_sends_again_and_a_refusing_gateway_sends_none(tmp_path):
    upstream = await Upstream().start()
    policy = EgressPolicy.from_config(policy_for(upstream))
    state_dir = tmp_path / "state"
    options = {"egress_policy": policy, "state_dir": state_dir}
    gw = await start_gateway(tmp_path, on_exit="keep", **options)
    running = True
    try:
        _, session = await gw.request("POST", "/api/sessions", {"limits": {"network": {"allow": ["allowed.test"]}}})
        sid = session["id"]
        url = f"http://allowed.test:{upstream.http_port}/hi"

        async def run(code: str) -> dict:
            status, reply = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": code, "timeout": 60})
            assert status == 200 and reply["status"] == "ok", reply
            return reply

        await run(f"import urllib.request\nbody = urllib.request.urlopen('{url}').read()")
        await run("!echo from a shell")
        await run("x = len(body)")
        assert upstream.connections == 1

        assert (await gw.request("POST", f"/api/sessions/{sid}/pause"))[0] == 200
        status, resumed = await gw.request("POST", f"/api/sessions/{sid}/resume")
        assert status == 200 and resumed["restored_by"] == "replay", resumed
        effects = {cell["cell"]: cell["side_effects"] for cell in resumed["cells"]}
        assert effects == {1: ["network"], 2: ["shell"], 3: []}, resumed["cells"]
        assert upstream.connections == 2, "the report must match what the replay did: the request went again"

        assert (await gw.request("POST", f"/api/sessions/{sid}/pause"))[0] == 200
        await stop_gateway(gw)
        running = False
        gw = await start_gateway(tmp_path, on_exit="delete", replay_side_effects="refuse", **options)
        running = True
        status, refused = await gw.request("POST", f"/api/sessions/{sid}/resume")
        assert status == 409 and refused["error"] == "replay_refused", refused
        assert "cell 1: network" in refused["message"] and "cell 2: shell" in refused["message"]
        assert upstream.connections == 2, "a refused replay sent the request again"
        assert container_ids_of(sid) == []
        status, model = await gw.request("GET", f"/api/sessions/{sid}")
        assert status == 200 and model["state"] == "paused"
    finally:
        if running:
            await stop_gateway(gw)
        upstream.close()
