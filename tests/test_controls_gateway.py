"""The production controls as a gateway user sees them: each cell's accounting and the policy's
findings in the execute reply AND in the transcript's cell metadata (what JupyterLab shows), the
breakers in /api/health, and accounting turned off by the operator."""

from __future__ import annotations

import hashlib

import nbformat
import pytest

from sandkernel.agent import AsyncSandkernel, ExecutionRefusedError

from .conftest import RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import ALICE, running_gateway, start_gateway, stop_gateway

pytestmark = pytest.mark.docker

POLICY = 'default = "allow"\n[rules]\nos_system = "warn"\nctypes = "deny"\n'


@pytest.fixture(scope="module", params=RUNTIME_PARAMS)
async def gw(request, tmp_path_factory):
    require_runtime(request.param)
    tmp = tmp_path_factory.mktemp("controls")
    policy = tmp / "policy.toml"
    policy.write_text(POLICY)
    async with running_gateway(tmp, default_runtime=request.param, exec_policy_file=policy) as gateway:
        yield gateway


@pytest.fixture(scope="module")
async def gateway_session(gw):
    """A session made through the gateway's API on ``gw``: its JSON model (``id``, ``kernel``, ...)."""
    status, body = await gw.request("POST", "/api/sessions", {})
    assert status == 201, body
    yield body
    await gw.request("DELETE", f"/api/sessions/{body['id']}")


async def test_the_transcript_carries_each_cells_accounting_and_findings(gw, gateway_session):
    code = "import os\nopen('made.txt', 'w').write('hello')\nos.system('true')\nprint('done')"
    status, reply = await gw.request("POST", f"/api/sessions/{gateway_session['id']}/execute", {"code": code})
    assert status == 200 and reply["status"] == "ok", reply
    accounting = reply["accounting"]
    created = {item["path"]: item for item in accounting["files"]["created"]}
    assert created["made.txt"]["sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert created["made.txt"]["size"] == 5
    assert accounting["wall_seconds"] > 0 and accounting["cpu_seconds"] is not None
    assert [(f["rule"], f["action"], f["line"]) for f in reply["policy"]] == [("os_system", "warn", 3)]

    status, notebook = await gw.request("GET", f"/api/sessions/{gateway_session['id']}/notebook")
    assert status == 200
    nbformat.validate(nbformat.from_dict(notebook))
    cell = next(c for c in notebook["cells"] if c["cell_type"] == "code" and "made.txt" in c["source"])
    recorded = cell["metadata"]["sandkernel"]
    assert recorded["accounting"] == accounting  # the same numbers the caller got
    assert recorded["policy"] == reply["policy"]


async def test_health_shows_the_breakers_to_a_tenant_only(gw, gateway_session):
    status, health = await gw.request("GET", "/api/health")
    assert status == 200 and health["status"] == "ok"
    assert health["breakers"]["sandbox_starts"]["state"] == "closed"
    assert health["breakers"]["quarantined_sessions"] == 0
    _, anonymous = await gw.request("GET", "/api/health", token=None)
    assert anonymous["status"] == "ok" and "breakers" not in anonymous


async def test_the_operator_can_turn_accounting_off(tmp_path):
    require_runtime("runc")
    gateway = await start_gateway(tmp_path, accounting=False)
    try:
        status, session = await gateway.request("POST", "/api/sessions", {})
        assert status == 201, session
        _, reply = await gateway.request("POST", f"/api/sessions/{session['id']}/execute", {"code": "1 + 1"})
        assert reply["status"] == "ok" and reply["accounting"] is None
        _, notebook = await gateway.request("GET", f"/api/sessions/{session['id']}/notebook")
        assert "accounting" not in notebook["cells"][-1]["metadata"]["sandkernel"]
    finally:
        await stop_gateway(gateway)


async def test_an_upload_is_not_charged_to_the_next_cell(gw, gateway_session):
    status, _ = await gw.request("PUT", f"/api/sessions/{gateway_session['id']}/files/uploaded.csv", raw=b"a,b\n1,2\n")
    assert status == 201
    code = "open('derived.txt', 'w').write(open('uploaded.csv').read().upper())"
    _, reply = await gw.request("POST", f"/api/sessions/{gateway_session['id']}/execute", {"code": code})
    created = [item["path"] for item in reply["accounting"]["files"]["created"]]
    assert created == ["derived.txt"], reply["accounting"]


async def test_the_client_raises_a_refusal_as_its_own_error(gw, gateway_session):
    async with AsyncSandkernel(gw.url, ALICE) as client:
        remote = await client.get_session(gateway_session["id"])
        refused = await remote.run("import ctypes")
        assert refused.status == "refused" and refused.refusal["rule"] == "ctypes"
        with pytest.raises(ExecutionRefusedError) as raised:
            await remote.run("import ctypes", check=True)
        assert "ctypes" in str(raised.value)
        assert (await remote.run("print('still here')", check=True)).stdout == "still here\n"
