"""Acceptance: a real ``jupyter server --gateway-url`` (jupyter_server's GatewayClient, what
JupyterLab uses) lists our kernelspecs, starts a sandboxed kernel, executes through its
websocket, and attaches to the live kernel of an agent session (notebook debugging)."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import pytest
from tornado.websocket import websocket_connect

from .gateway_fixtures import ALICE, running_gateway
from .jupyter_server import JupyterServer, jupyter_server
from .test_gateway import execute_request

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
async def stack(tmp_path_factory):
    async with (
        running_gateway(tmp_path_factory.mktemp("gw")) as gateway,
        jupyter_server(gateway.url, tmp_path_factory.mktemp("root")) as lab,
    ):
        yield gateway, lab


async def run_through_jupyter(lab: JupyterServer, kernel_id: str, code: str) -> dict:
    ws = await websocket_connect(lab.websocket_request(kernel_id, uuid.uuid4().hex))
    msg = execute_request(code)
    await ws.write_message(json.dumps(msg))
    try:

        async def wait_result():
            while True:
                data = json.loads(await ws.read_message())
                if data.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
                    continue
                if data["header"]["msg_type"] in ("execute_result", "error"):
                    return data

        return await asyncio.wait_for(wait_result(), 120)
    finally:
        ws.close()


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
async def test_jupyter_server_uses_the_gateway(stack):
    gateway, lab = stack
    code, specs = await lab.call("GET", "/api/kernelspecs")
    assert code == 200 and "sandkernel-python" in specs["kernelspecs"]
    code, kernel = await lab.call("POST", "/api/kernels", {"name": "sandkernel-python"})
    assert code == 201, kernel
    kid = kernel["id"]
    _, ours = await gateway.request("GET", "/api/kernels")
    assert kid in [k["id"] for k in ours], "the kernel must live on the gateway"
    result = await run_through_jupyter(lab, kid, "import os\nos.getuid() * 0 + 42")
    assert result["content"]["data"]["text/plain"] == "42"
    code, _ = await lab.call("DELETE", f"/api/kernels/{kid}")
    assert code == 204
    _, ours = await gateway.request("GET", "/api/kernels")
    assert kid not in [k["id"] for k in ours]


async def test_attach_to_an_agent_sessions_live_kernel(stack):
    gateway, lab = stack
    code, session = await gateway.request("POST", "/api/sessions", {"metadata": {"agent": "debug-me"}})
    assert code == 201
    try:
        code, result = await gateway.request(
            "POST",
            f"/api/sessions/{session['id']}/execute",
            {"code": "agent_state = {'step': 3, 'note': 'from the agent'}"},
        )
        assert result["status"] == "ok"
        # `sandkernel attach` prints the steps, naming this kernel.
        attach = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sandkernel.cli",
            "attach",
            session["id"],
            "--url",
            gateway.url,
            "--token",
            ALICE,
            stdout=asyncio.subprocess.PIPE,
        )
        printed = (await attach.communicate())[0].decode()
        assert attach.returncode == 0 and f'"kernel_id": "{session["kernel"]["id"]}"' in printed
        assert f"DELETE /api/sessions/{session['id']}" in printed
        # Adopt the agent's kernel in jupyter_server, as printed.
        code, adopted = await lab.call("POST", "/api/kernels", {"kernel_id": session["kernel"]["id"]})
        assert code == 201 and adopted["id"] == session["kernel"]["id"]
        code, kernels = await lab.call("GET", "/api/kernels")
        assert session["kernel"]["id"] in [k["id"] for k in kernels]
        seen = await run_through_jupyter(lab, session["kernel"]["id"], "agent_state['note']")
        assert seen["content"]["data"]["text/plain"] == "'from the agent'"
        # Shutting the kernel down from JupyterLab must not end the agent's session.
        code, _ = await lab.call("DELETE", f"/api/kernels/{session['kernel']['id']}")
        assert code != 204
        code, result = await gateway.request(
            "POST", f"/api/sessions/{session['id']}/execute", {"code": "agent_state['step']"}
        )
        assert result["status"] == "ok" and result["outputs"][0]["data"]["text/plain"] == "3"
        _, nb = await gateway.request("GET", f"/api/sessions/{session['id']}/notebook")
        sources = [c["metadata"]["sandkernel"].get("source") for c in nb["cells"] if c["cell_type"] == "code"]
        assert "websocket" in sources  # what the person ran from Jupyter is in the transcript too
    finally:
        await gateway.request("DELETE", f"/api/sessions/{session['id']}")
