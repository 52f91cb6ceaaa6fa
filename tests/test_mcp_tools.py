"""The MCP tools, driven by the real ``mcp`` SDK client against a real gateway's sessions.

The client talks to the server in-process (the SDK's own in-memory transport: the same
MCPServer, the same JSON-RPC dispatch and result validation as over stdio or HTTP), so these
tests are about what the tools answer; tests/test_mcp_stdio.py covers the stdio process and its
lifecycle. One gateway per runtime serves the whole module (few container starts: 2 cores).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import nbformat
import pytest
from mcp import Client
from mcp_types import EmbeddedResource, ImageContent, TextContent
from PIL import Image

from sandkernel.gateway.mcp.resolver import TenantResolver
from sandkernel.gateway.mcp.tools import build_mcp_server
from sandkernel.images import MAX_EDGE
from sandkernel.notebooks.compare import Verdict
from sandkernel.notebooks.replay import replay
from tests.conftest import RUNTIMES, require_runtime
from tests.gateway_fixtures import start_gateway, stop_gateway


@pytest.fixture(scope="module", params=RUNTIMES)
async def mcp_stack(request, tmp_path_factory):
    """A gateway on ``runtime``, alice's resolver and her MCP client; bob's resolver for the
    tenant test. Yields (client, alice, bob, gateway)."""
    require_runtime(request.param)
    tmp = tmp_path_factory.mktemp(f"mcp-{request.param}")
    gateway = await start_gateway(tmp, default_runtime=request.param, notebook_dir=tmp / "notebooks")
    alice = TenantResolver(gateway.server.registry, "alice")
    bob = TenantResolver(gateway.server.registry, "bob")
    server = build_mcp_server(lambda ctx: alice, gateway.settings.budget)
    # The client's task group must be entered and left by one task; a module fixture's set-up
    # and teardown run in different ones, so the client lives in a task of its own.
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    done = asyncio.Event()

    async def hold() -> None:
        async with Client(server, read_timeout_seconds=300) as client:
            ready.set_result(client)
            await done.wait()

    holder = asyncio.create_task(hold())
    try:
        client = await asyncio.wait_for(asyncio.shield(ready), 60)
        yield client, alice, bob, gateway
    finally:
        done.set()
        await holder
        await alice.close_all()
        await stop_gateway(gateway)


def text_of(result) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


async def test_state_is_kept_errors_carry_the_traceback(mcp_stack):
    client, alice, _, _ = mcp_stack
    first = await client.call_tool("run_python", {"code": "x = 41"})
    assert not first.is_error, text_of(first)
    second = await client.call_tool("run_python", {"code": "x + 1"})
    assert not second.is_error
    assert text_of(second) == "42"
    assert second.structured_content["status"] == "ok"
    assert second.structured_content["execution_count"] == first.structured_content["execution_count"] + 1
    assert second.structured_content["session_id"] == alice.default_id
    assert second.structured_content["truncation"]["truncated"] is False
    assert second.structured_content["duration"] >= 0

    failed = await client.call_tool("run_python", {"code": "def f():\n    return 1 / 0\nf()"})
    assert failed.is_error
    assert failed.structured_content["status"] == "error"
    assert failed.structured_content["error"]["name"] == "ZeroDivisionError"
    trace = text_of(failed)
    assert "Traceback" in trace and "return 1 / 0" in trace and "ZeroDivisionError: division by zero" in trace
    assert "\x1b[" not in trace  # colour codes stripped for the model


async def test_a_figure_comes_back_as_image_content_downscaled(mcp_stack):
    client, *_ = mcp_stack
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('sales')\nplt.show()"
    result = await client.call_tool("run_python", {"code": code})
    assert not result.is_error, text_of(result)
    images = [b for b in result.content if isinstance(b, ImageContent)]
    assert len(images) == 1 and images[0].mime_type == "image/png"
    assert Image.open(io.BytesIO(base64.b64decode(images[0].data))).format == "PNG"

    big = "from PIL import Image\nImage.new('RGB', (4000, 3000), 'red')"
    result = await client.call_tool("run_python", {"code": big})
    [image] = [b for b in result.content if isinstance(b, ImageContent)]
    width, height = Image.open(io.BytesIO(base64.b64decode(image.data))).size
    assert max(width, height) <= MAX_EDGE and width * height <= 1_150_000
    assert abs(width / height - 4 / 3) < 0.01


async def test_run_shell_reports_exit_codes_and_timeouts(mcp_stack):
    client, *_ = mcp_stack
    ok = await client.call_tool("run_shell", {"command": "echo hello; echo oops >&2"})
    assert not ok.is_error
    assert ok.structured_content["exit_code"] == 0
    assert "hello" in ok.structured_content["output"] and "oops" in ok.structured_content["output"]
    failed = await client.call_tool("run_shell", {"command": "echo partial; exit 3"})
    assert failed.is_error
    assert failed.structured_content["exit_code"] == 3
    assert "exit code 3" in text_of(failed) and "partial" in text_of(failed)
    slow = await client.call_tool("run_shell", {"command": "sleep 30", "timeout": 1})
    assert slow.is_error and slow.structured_content["timed_out"] is True
    assert slow.structured_content["exit_code"] == 124
    # the shell and Python share the session: a file one writes the other reads
    await client.call_tool("run_shell", {"command": "echo from-shell > shared.txt"})
    read = await client.call_tool("run_python", {"code": "open('shared.txt').read().strip()"})
    assert text_of(read) == "'from-shell'"


async def test_files_round_trip(mcp_stack):
    client, *_ = mcp_stack
    up = await client.call_tool("upload_file", {"path": "data/notes.txt", "content": "héllo\nworld\n"})
    assert not up.is_error, text_of(up)
    binary = bytes(range(256)) * 4
    payload = base64.b64encode(binary).decode()
    up = await client.call_tool("upload_file", {"path": "data/blob.bin", "content": payload, "encoding": "base64"})
    assert not up.is_error, text_of(up)
    seen = await client.call_tool("run_python", {"code": "len(open('data/blob.bin','rb').read())"})
    assert text_of(seen) == "1024"

    text = await client.call_tool("download_file", {"path": "data/notes.txt"})
    assert text_of(text) == "héllo\nworld\n" and text.structured_content["encoding"] == "text"
    blob = await client.call_tool("download_file", {"path": "data/blob.bin"})
    [resource] = [b for b in blob.content if isinstance(b, EmbeddedResource)]
    assert base64.b64decode(resource.resource.blob) == binary
    listing = await client.call_tool("list_files", {"path": "data"})
    names = {e["name"]: e for e in listing.structured_content["entries"]}
    assert names["blob.bin"]["size"] == 1024 and names["notes.txt"]["type"] == "file"

    # refusals are tool errors that say what to fix; the server keeps serving
    outside = await client.call_tool("download_file", {"path": "../../etc/passwd"})
    assert outside.is_error and "outside the workspace" in text_of(outside)
    missing = await client.call_tool("download_file", {"path": "nope.txt"})
    assert missing.is_error and "no file" in text_of(missing)
    bad = await client.call_tool("upload_file", {"path": "x.bin", "content": "%%%", "encoding": "base64"})
    assert bad.is_error and "base64" in text_of(bad)
    wrong_type = await client.call_tool("run_python", {"code": 5})
    assert wrong_type.is_error and "code" in text_of(wrong_type)
    after = await client.call_tool("run_python", {"code": "2 + 2"})
    assert text_of(after) == "4"


async def test_variables_interrupt_restart(mcp_stack):
    client, *_ = mcp_stack
    await client.call_tool("run_python", {"code": "numbers = list(range(10))"})
    listed = await client.call_tool("list_variables", {})
    names = {v["name"] for v in listed.structured_content["variables"]}
    assert "numbers" in names

    running = asyncio.create_task(client.call_tool("run_python", {"code": "import time\ntime.sleep(60)"}))
    for _ in range(100):  # wait for the run to start: the session reports busy
        listed_sessions = await client.call_tool("list_sessions", {})
        if any(s["state"] == "busy" for s in listed_sessions.structured_content["sessions"]):
            break
        await asyncio.sleep(0.1)
    stopped = await client.call_tool("interrupt", {})
    assert not stopped.is_error
    result = await asyncio.wait_for(running, 30)
    assert result.is_error and "KeyboardInterrupt" in text_of(result)
    kept = await client.call_tool("run_python", {"code": "len(numbers)"})
    assert text_of(kept) == "10"

    restarted = await client.call_tool("restart", {})
    assert not restarted.is_error
    gone = await client.call_tool("run_python", {"code": "numbers"})
    assert gone.is_error and "NameError" in text_of(gone)


async def test_sessions_are_separate_and_tenants_cannot_reach_each_other(mcp_stack):
    client, alice, bob, _ = mcp_stack
    created = await client.call_tool("create_session", {"name": "second"})
    assert not created.is_error, text_of(created)
    other = created.structured_content["session_id"]
    assert other != alice.default_id
    await client.call_tool("run_python", {"code": "y = 'second'", "session_id": other})
    default_y = await client.call_tool("run_python", {"code": "'y' in dir()"})
    assert text_of(default_y) == "False"
    listed = await client.call_tool("list_sessions", {})
    assert {alice.default_id, other} <= {s["session_id"] for s in listed.structured_content["sessions"]}

    # bob's resolver: alice's id answers exactly as an unknown id does
    bob_server = build_mcp_server(lambda ctx: bob, alice.registry.settings.budget)
    async with Client(bob_server) as bob_client:
        foreign = await bob_client.call_tool("run_python", {"code": "y", "session_id": other})
        unknown = await bob_client.call_tool("run_python", {"code": "y", "session_id": "0" * 32})
        assert foreign.is_error and unknown.is_error
        assert text_of(foreign).replace(other, "ID") == text_of(unknown).replace("0" * 32, "ID")
        closing = await bob_client.call_tool("close_session", {"session_id": other})
        assert closing.is_error
        assert (await bob_client.call_tool("list_sessions", {})).structured_content["sessions"] == []
    still = await client.call_tool("run_python", {"code": "y", "session_id": other})
    assert text_of(still) == "'second'"

    closed = await client.call_tool("close_session", {"session_id": other})
    assert not closed.is_error
    after = await client.call_tool("run_python", {"code": "1", "session_id": other})
    assert after.is_error and "list_sessions" in text_of(after)


async def test_the_notebook_resource_records_mcp_runs_and_replays(mcp_stack):
    client, alice, _, _ = mcp_stack
    await client.call_tool("run_python", {"code": "total = sum(range(5))\nprint(total)"})
    uri = f"sandkernel://sessions/{alice.default_id}/notebook"
    read = await client.read_resource(uri)
    notebook = nbformat.reads(read.contents[0].text, as_version=4)
    nbformat.validate(notebook)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert code_cells and all(c.metadata["sandkernel"].get("source") == "mcp" for c in code_cells)
    assert any("total = sum(range(5))" in c.source for c in code_cells)

    templates = await client.list_resource_templates()
    assert [t.uri_template for t in templates.resource_templates] == ["sandkernel://sessions/{session_id}/notebook"]

    # a short notebook of its own (this module's session has sleeps and restarts in it)
    created = await client.call_tool("create_session", {})
    sid = created.structured_content["session_id"]
    for code in ("a = 6", "b = 7", "print(a * b)"):
        await client.call_tool("run_python", {"code": code, "session_id": sid})
    path = alice.registry.get("alice", sid).recorder.path
    await alice.registry.get("alice", sid).recorder.flushed()
    outcome = await replay(path)  # on the runtime the transcript recorded
    assert [v.verdict for v in outcome.verdicts] == [Verdict.SAME] * 3
    assert json.loads(path.read_text())["cells"][-1]["outputs"][0]["text"] == "42\n"
    await client.call_tool("close_session", {"session_id": sid})
