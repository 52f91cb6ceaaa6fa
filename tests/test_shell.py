"""Shell commands as kernel cells (sandkernel/shell.py, POST /api/sessions/{id}/shell, the
client's ``session.shell``): exit codes, merged output, a timeout that kills the command's whole
process group, a flood cut to head and tail, the door recorded in the transcript, and refusals
that say what to fix while the session keeps working."""

from __future__ import annotations

import pytest

from sandkernel.agent.client import AsyncSandkernel
from sandkernel.python_syntax import parse
from sandkernel.shell import SHELL_MIME, TIMED_OUT_EXIT_CODE, ShellResult, shell_code, shell_result

from .gateway_fixtures import ALICE, BOB, gateway_fixture


@pytest.mark.parametrize("command", ["echo hi", "a\x00b\nc", '{x} \'q\' """ \\', "\u2028x", "# $ not a headline"])
def test_every_command_makes_a_valid_cell_that_names_it(command):
    cell = shell_code(command, 3)
    parse(cell)  # NUL bytes, line separators and quotes cannot break the cell
    assert cell.startswith("# $ ") and "\n" in cell


def test_results_read_back_defensively():
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": ["a", "b\n"]},
        {"output_type": "display_data", "data": {SHELL_MIME: {"exit_code": 3, "timed_out": False}}},
    ]
    assert shell_result(outputs) == ShellResult(output="ab\n", exit_code=3)
    forged = [{"output_type": "display_data", "data": {SHELL_MIME: {"exit_code": True, "timed_out": "yes"}}}]
    assert shell_result(forged) == ShellResult(output="", exit_code=None)
    assert shell_result([{"output_type": "display_data", "data": {SHELL_MIME: ["junk"]}}]).exit_code is None


gw = gateway_fixture(runtimes=True)


@pytest.fixture(scope="module")
async def gateway_session(gw):
    """A session made through the gateway's API on ``gw``: its JSON model (``id``, ``kernel``, ...)."""
    status, body = await gw.request("POST", "/api/sessions", {})
    assert status == 201, body
    yield body
    await gw.request("DELETE", f"/api/sessions/{body['id']}")


async def shell(gw, session, body: dict, token: str = ALICE) -> tuple[int, dict]:
    return await gw.request("POST", f"/api/sessions/{session['id']}/shell", body, token=token)


async def test_a_command_reports_its_exit_code_and_merged_output(gw, gateway_session):
    status, reply = await shell(gw, gateway_session, {"command": "cd /tmp; pwd >&2; echo out; exit 3"})
    assert status == 200, reply
    assert reply["status"] == "ok" and reply["exit_code"] == 3 and not reply["timed_out"]
    assert reply["output"] == "/tmp\nout\n"
    status, reply = await shell(gw, gateway_session, {"command": "pwd; printf 'a b' > 'with space.txt'; ls"})
    assert reply["exit_code"] == 0 and reply["output"].splitlines() == ["/workspace", "with space.txt"]


async def test_a_timed_out_command_is_killed_with_its_children(gw, gateway_session):
    command = "(sleep 300; touch /workspace/survived) & echo started; sleep 300"
    status, reply = await shell(gw, gateway_session, {"command": command, "timeout": 2})
    assert status == 200, reply
    assert reply["timed_out"] and reply["exit_code"] == TIMED_OUT_EXIT_CODE and reply["output"] == "started\n"
    _, ps = await shell(gw, gateway_session, {"command": "ps -eo args | grep -c '^sleep 300' || true"})
    assert ps["output"].strip() == "0", ps  # the background child went with the group
    _, check = await gw.request("POST", f"/api/sessions/{gateway_session['id']}/execute", {"code": "6 * 7"})
    assert check["status"] == "ok" and check["text"].strip() == "42"


async def test_a_flood_comes_back_as_head_and_tail(gw, gateway_session):
    command = "echo FIRST; head -c 5000000 /dev/zero | tr '\\0' x; echo; echo LAST"
    status, reply = await shell(gw, gateway_session, {"command": command})
    assert status == 200 and reply["exit_code"] == 0 and reply["truncated"]
    assert reply["output"].startswith("FIRST\n") and reply["output"].endswith("LAST\n")
    assert "bytes cut" in reply["output"] and len(reply["output"]) < 80 * 1024
    # A caller may ask for more, up to MAX_SHELL_OUTPUT_LIMIT: the same flood's first 1 MiB whole.
    command = "head -c 1000000 /dev/zero | tr '\\0' y"
    status, reply = await shell(gw, gateway_session, {"command": command, "output_limit": 1024 * 1024})
    assert status == 200 and not reply["truncated"] and reply["output"] == "y" * 1_000_000


async def test_the_transcript_records_the_command_and_the_claimed_door(gw, gateway_session):
    status, reply = await shell(gw, gateway_session, {"command": "echo recorded", "source": "deepagents"})
    assert status == 200 and reply["output"] == "recorded\n"
    _, notebook = await gw.request("GET", f"/api/sessions/{gateway_session['id']}/notebook")
    cell = [c for c in notebook["cells"] if c["source"].startswith("# $ echo recorded")][-1]
    assert cell["metadata"]["sandkernel"]["source"] == "deepagents"
    assert cell["outputs"][0]["text"] == "recorded\n"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "'command' must be a non-empty string"),
        ({"command": "  "}, "'command' must be a non-empty string"),
        ({"command": ["ls"]}, "'command' must be a non-empty string"),
        ({"command": "ls", "timeout": "soon"}, "timeout must be a number of seconds"),
        ({"command": "ls", "source": "mcp"}, "'source' must be one of"),  # only the gateway's own MCP says mcp
        ({"command": "x" * (256 * 1024 + 1)}, "upload a script"),
        ({"command": "ls", "output_limit": 10**9}, "'output_limit' is a number of bytes from 1024 to"),
        ({"command": "ls", "output_limit": "all"}, "'output_limit' is a number of bytes"),
        ({"command": "ls", "output_limit": True}, "'output_limit' is a number of bytes"),
    ],
)
async def test_bad_requests_say_what_to_fix(gw, gateway_session, body, message):
    status, reply = await shell(gw, gateway_session, body)
    assert status == 400 and message in reply["message"], reply
    _, ok = await shell(gw, gateway_session, {"command": "echo still here"})
    assert ok["output"] == "still here\n"


async def test_another_tenant_cannot_run_commands_in_the_session(gw, gateway_session):
    status, reply = await shell(gw, gateway_session, {"command": "touch /workspace/bob-was-here"}, token=BOB)
    assert status == 404, reply
    _, ls = await shell(gw, gateway_session, {"command": "ls /workspace"})
    assert "bob-was-here" not in ls["output"]


async def test_the_client_runs_commands_and_claims_its_door(gw, gateway_session):
    async with AsyncSandkernel(gw.url, ALICE) as client:
        remote = await client.get_session(gateway_session["id"])
        result = await remote.shell("echo $((6 * 7)); false", source="langchain")
        assert result == ShellResult(output="42\n", exit_code=1, status="ok")
        execution = await remote.run("print('via run')", source="agent")
        assert execution.stdout == "via run\n"
    _, notebook = await gw.request("GET", f"/api/sessions/{gateway_session['id']}/notebook")
    doors = [c["metadata"]["sandkernel"].get("source") for c in notebook["cells"] if c["cell_type"] == "code"]
    assert doors[-2:] == ["langchain", "agent"]
