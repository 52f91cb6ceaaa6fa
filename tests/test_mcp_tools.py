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
from sandkernel.gateway.service import SessionService
from sandkernel.images import MAX_EDGE
from sandkernel.notebooks.compare import Verdict
from sandkernel.notebooks.replay import replay
from tests.conftest import DOOR_RUNTIME_PARAMS, require_runtime
from tests.gateway_fixtures import start_gateway, stop_gateway

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module", params=DOOR_RUNTIME_PARAMS)
async def mcp_stack(request, tmp_path_factory):
    """A gateway on ``runtime``, alice's resolver and her MCP client; bob's resolver for the
    tenant test. Yields (client, alice, bob, gateway)."""
    require_runtime(request.param)
    tmp = tmp_path_factory.mktemp(f"mcp-{request.param}")
    gateway = await start_gateway(tmp, default_runtime=request.param, notebook_dir=tmp / "notebooks")
    alice = TenantResolver(gateway.server.registry, "alice")
    bob = TenantResolver(gateway.server.registry, "bob")
    server = build_mcp_server(lambda ctx: alice, gateway.server.service)
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

    code = "import time\nopen('started', 'w').close()\ntime.sleep(60)"
    running = asyncio.create_task(client.call_tool("run_python", {"code": code}))
    # Wait for the code itself to run (its file): a session already busy can have the kernel
    # before the cell takes SIGINT, and an interrupt sent then is ignored.
    async with asyncio.timeout(60):
        while "started" not in {e["name"] for e in (await client.call_tool("list_files", {})).structured_content["entries"]}:
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
    bob_server = build_mcp_server(lambda ctx: bob, SessionService(alice.registry.settings.budget))
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


# -- snapshots: pause, resume, fork, rewind --------------------------------------------------


async def new_session(client, *cells: str) -> str:
    """A session of its own (the module's default one has restarts and sleeps in its notebook),
    with ``cells`` run in it."""
    created = await client.call_tool("create_session", {})
    assert not created.is_error, text_of(created)
    sid = created.structured_content["session_id"]
    for code in cells:
        ran = await client.call_tool("run_python", {"code": code, "session_id": sid})
        assert not ran.is_error, text_of(ran)
    return sid


async def test_fork_two_then_the_forks_diverge(mcp_stack):
    client, alice, _, _ = mcp_stack
    sid = await new_session(client, "base = [1, 2]", "open('note.txt', 'w').write('parent')")
    before = {s["session_id"] for s in (await client.call_tool("list_sessions", {})).structured_content["sessions"]}

    # a count out of range is refused before anything starts, with the range in the message
    for count in (0, 11):
        refused = await client.call_tool("fork_session", {"count": count, "session_id": sid})
        assert refused.is_error and "1 to 10" in text_of(refused), text_of(refused)
    wrong_cell = await client.call_tool("fork_session", {"cell": 9, "session_id": sid})
    assert wrong_cell.is_error and "1 to 2" in text_of(wrong_cell), text_of(wrong_cell)
    listed = await client.call_tool("list_sessions", {})
    assert {s["session_id"] for s in listed.structured_content["sessions"]} == before

    forked = await client.call_tool("fork_session", {"count": 2, "session_id": sid})
    assert not forked.is_error, text_of(forked)
    forks = forked.structured_content["forks"]
    ids = [f["session_id"] for f in forks]
    assert len(set(ids)) == 2 and sid not in ids and not set(ids) & before
    for fork in forks:
        assert fork["restored_by"] == "replay" and fork["reproduced"] is True
        assert [(c["cell"], c["verdict"]) for c in fork["cells"]] == [(1, "same"), (2, "same")]
        assert fork["files"] == "snapshot"
        assert fork["session_id"] in text_of(forked)
    assert "every one as recorded" in text_of(forked)
    assert set(ids) <= alice.started  # they end with the caller, like sessions it created

    for fork, tag in zip(ids, ("a", "b"), strict=True):
        changed = await client.call_tool("run_python", {"code": f"base.append({tag!r}); base", "session_id": fork})
        assert not changed.is_error, text_of(changed)
    for where, expected in ((ids[0], "[1, 2, 'a']"), (ids[1], "[1, 2, 'b']"), (sid, "[1, 2]")):
        seen = await client.call_tool("run_python", {"code": "base", "session_id": where})
        assert text_of(seen) == expected
    note = await client.call_tool("run_python", {"code": "open('note.txt').read()", "session_id": ids[1]})
    assert text_of(note) == "'parent'"
    for closing in (*ids, sid):
        assert not (await client.call_tool("close_session", {"session_id": closing})).is_error


async def test_rewind_undoes_the_cells_that_broke_the_state(mcp_stack):
    client, *_ = mcp_stack
    sid = await new_session(
        client, "rows = list(range(5))", "rows = None\nopen('later.txt', 'w').write('made after cell 1')"
    )
    out_of_range = await client.call_tool("rewind_session", {"cell": 7, "session_id": sid})
    assert out_of_range.is_error and "1 to 2" in text_of(out_of_range), text_of(out_of_range)

    rewound = await client.call_tool("rewind_session", {"cell": 1, "session_id": sid})
    assert not rewound.is_error, text_of(rewound)
    assert rewound.structured_content["rewound_to"] == 1
    assert rewound.structured_content["restored_by"] == "replay"
    cells = [(c["cell"], c["verdict"]) for c in rewound.structured_content["cells"]]
    assert cells == [(1, "same"), (2, "not run")]  # cell 2 is undone: not re-run
    assert "rewound to right after cell 1, restored by replay: 1 cell(s) re-run" in text_of(rewound)
    rows = await client.call_tool("run_python", {"code": "rows", "session_id": sid})
    assert text_of(rows) == "[0, 1, 2, 3, 4]"
    later = await client.call_tool("run_python", {"code": "import os; os.path.exists('later.txt')", "session_id": sid})
    assert text_of(later) == "False"
    await client.call_tool("close_session", {"session_id": sid})


async def test_pause_then_run_python_resumes_and_other_tenants_see_nothing(mcp_stack):
    client, alice, bob, _ = mcp_stack
    sid = await new_session(client, "y = 6 * 7", "open('kept.txt', 'w').write('on disk')")
    registry = alice.registry

    paused = await client.call_tool("pause_session", {"session_id": sid})
    assert not paused.is_error, text_of(paused)
    assert paused.structured_content["state"] == "paused"
    assert paused.structured_content["snapshot"]["cells"] == 2
    assert registry.paused("alice", sid) is not None  # no container: really paused
    again = await client.call_tool("pause_session", {"session_id": sid})
    assert not again.is_error and "already paused" in text_of(again)
    listed = await client.call_tool("list_sessions", {})
    [entry] = [s for s in listed.structured_content["sessions"] if s["session_id"] == sid]
    assert entry["state"] == "paused"

    # bob: alice's session, paused or live, answers as an unknown id does, and is left alone
    bob_server = build_mcp_server(lambda ctx: bob, SessionService(registry.settings.budget))
    calls = {
        "pause_session": {},
        "resume_session": {},
        "fork_session": {"count": 1},
        "rewind_session": {"cell": 1},
        "run_python": {"code": "y"},
    }
    async with Client(bob_server) as bob_client:
        for tool, args in calls.items():
            foreign = await bob_client.call_tool(tool, {**args, "session_id": sid})
            unknown = await bob_client.call_tool(tool, {**args, "session_id": "0" * 32})
            assert foreign.is_error and unknown.is_error, tool
            assert text_of(foreign).replace(sid, "ID") == text_of(unknown).replace("0" * 32, "ID"), tool
            assert registry.paused("alice", sid) is not None, tool  # still paused: nothing resumed it
    assert registry.list("bob") == []

    # a run on the paused session resumes it by itself, with its variables and files
    resumed = await client.call_tool("run_python", {"code": "y, open('kept.txt').read()", "session_id": sid})
    assert not resumed.is_error, text_of(resumed)
    assert text_of(resumed) == "(42, 'on disk')"
    assert registry.paused("alice", sid) is None

    # the explicit resume reports how the state came back; on a running session it does nothing
    await client.call_tool("pause_session", {"session_id": sid})
    report = await client.call_tool("resume_session", {"session_id": sid})
    assert not report.is_error, text_of(report)
    assert report.structured_content["restored_by"] == "replay"
    assert report.structured_content["reproduced"] is True and report.structured_content["files"] == "snapshot"
    assert [c["verdict"] for c in report.structured_content["cells"]][:3] == ["same"] * 3
    running = await client.call_tool("resume_session", {"session_id": sid})
    assert not running.is_error and "nothing to resume" in text_of(running)
    await client.call_tool("close_session", {"session_id": sid})
