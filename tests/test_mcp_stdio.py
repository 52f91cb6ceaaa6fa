"""``sandkernel mcp``: the stdio MCP server as a desktop client runs it, and its lifecycle.

Every test spawns the real command (``python -m sandkernel.cli mcp``) through the real SDK's
stdio client. The lifecycle tests check the one promise that matters to a user who closes the
laptop lid: whichever way the client or the server goes (a clean exit, a SIGKILLed client, a
SIGTERM, a SIGKILLed server), no container labelled with the session is left, within a bound.
The containers belong to the server process, not to this test process, so the suite's own leak
check would not see them: each test looks for them by their ``sandkernel.session`` label.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import TextContent

from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, SESSION_LABEL
from sandkernel.kernels.sandbox.state_dir import STATE_DIR_LABEL
from tests.conftest import RUNC, RUNTIME_PARAMS, require_runtime

pytestmark = pytest.mark.docker

CLEANUP_BOUND = 60.0  # seconds for a gone client's containers to be removed (a loaded 2-core host)


def server_params(runtime: str, notebooks: Path) -> StdioServerParameters:
    args = [
        "-m",
        "sandkernel.cli",
        "--log-level",
        "INFO",
        "mcp",
        "--runtime",
        runtime,
        "--notebook-dir",
        str(notebooks),
    ]
    return StdioServerParameters(command=sys.executable, args=args, env=dict(os.environ))


def containers_of(session_id: str, sparse: bool = True) -> list:
    """The session's containers. Sparse (one listing, no inspect of each) unless their labels are
    needed: a container removed between the listing and its inspect would raise NotFound, which is
    exactly what the waits for a removal race against."""
    return default_engine().client.containers.list(
        all=True, sparse=sparse, filters={"label": f"{SESSION_LABEL}={session_id}"}
    )


def wait_until(condition, bound: float = CLEANUP_BOUND) -> bool:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def text_of(result) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, TextContent))


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
@pytest.mark.parametrize("runtime", [RUNC])
async def test_stdio_server_keeps_state_records_the_notebook_and_cleans_up_on_exit(runtime, tmp_path):
    require_runtime(runtime)
    notebooks = tmp_path / "notebooks"
    async with Client(server_params(runtime, notebooks), read_timeout_seconds=300) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert {"run_python", "run_shell", "upload_file", "download_file", "list_files", "restart"} <= tools
        first = await client.call_tool("run_python", {"code": "x = 41"})
        assert not first.is_error, text_of(first)
        session_id = first.structured_content["session_id"]
        second = await client.call_tool("run_python", {"code": "x + 1"})
        assert text_of(second) == "42"
        failed = await client.call_tool("run_python", {"code": "undefined_name"})
        assert failed.is_error and "NameError" in text_of(failed) and "Traceback" in text_of(failed)
        figure = await client.call_tool("run_python", {"code": FIGURE})
        [image] = [block for block in figure.content if block.type == "image"]
        assert image.mime_type == "image/png" and base64.b64decode(image.data).startswith(b"\x89PNG")
        assert containers_of(session_id)
    # the client's exit closed stdin: the server deleted the session before it exited
    assert wait_until(lambda: not containers_of(session_id)), "the session's container outlived the client"
    [path] = notebooks.glob("*.ipynb")
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    assert [c.source for c in cells] == ["x = 41", "x + 1", "undefined_name", FIGURE]
    assert {c.metadata["sandkernel"]["source"] for c in cells} == {"mcp"}
    assert cells[1].outputs[0]["data"]["text/plain"] == "42"


FIGURE = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"

CLIENT = """
import asyncio, json, os, sys
from mcp import Client
from mcp.client.stdio import StdioServerParameters

async def main():
    params = StdioServerParameters(command=sys.executable, args={args!r}, env=dict(os.environ))
    async with Client(params, read_timeout_seconds=300) as client:
        result = await client.call_tool("run_python", {{"code": "import time; x = 1"}})
        print(json.dumps(result.structured_content), flush=True)
        await asyncio.Event().wait()  # until killed

asyncio.run(main())
"""


def start_client(tmp_path: Path, runtime: str) -> tuple[subprocess.Popen, str, int, str]:
    """A client process holding a server with a live session: (client, session id, server pid,
    server state dir)."""
    params = server_params(runtime, tmp_path / "notebooks")
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(CLIENT.format(args=params.args)))
    log = open(tmp_path / "client.log", "w")  # noqa: SIM115 (closed with the process)
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=log, text=True)
    line = client.stdout.readline()
    assert line, f"the client ended without a session: {(tmp_path / 'client.log').read_text()[-2000:]}"
    session_id = json.loads(line)["session_id"]
    [container] = containers_of(session_id, sparse=False)
    server_pid = int(container.labels[OWNER_LABEL].split(":")[1])
    return client, session_id, server_pid, container.labels[STATE_DIR_LABEL]


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
def test_a_sigkilled_client_leaves_no_container(runtime, tmp_path):
    require_runtime(runtime)
    client, session_id, server_pid, _ = start_client(tmp_path, runtime)
    client.kill()
    client.wait(10)
    # the server saw stdin close (its client is gone) and removed the session
    assert wait_until(lambda: not containers_of(session_id)), "a killed client's session container was left"
    assert wait_until(lambda: not pid_alive(server_pid), 30), "the server outlived its client"


@pytest.mark.parametrize("runtime", [RUNC])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signalled_server_leaves_no_container(runtime, sig, tmp_path):
    """SIGTERM: the server cleans up and exits though its client still holds stdin open. SIGKILL
    (what MCP clients send a few seconds after SIGTERM): its undertaker removes the containers and
    the state dir (a later gateway's reaper would keep them: they are in that dir's catalog)."""
    require_runtime(runtime)
    client, session_id, server_pid, state_dir = start_client(tmp_path, runtime)
    try:
        os.kill(server_pid, sig)
        assert wait_until(lambda: not pid_alive(server_pid), 30), f"the server ignored {sig.name}"
        assert wait_until(lambda: not containers_of(session_id)), f"a {sig.name}ed server's container was left"
        assert wait_until(lambda: not Path(state_dir).exists(), 30), "the server's state dir was left"
    finally:
        client.kill()
        client.wait(10)


@pytest.mark.parametrize("runtime", [RUNC])
def test_a_bad_profile_is_refused_at_start_on_stderr_with_stdout_untouched(runtime):
    require_runtime(runtime)
    args = [sys.executable, "-m", "sandkernel.cli", "mcp", "--runtime", runtime, "--profile", "nosuch"]
    done = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown profile 'nosuch'" in done.stderr
    assert done.stdout == ""  # stdout belongs to the protocol
