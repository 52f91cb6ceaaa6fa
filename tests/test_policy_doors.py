"""The execution policy through real doors: a gateway started with ``exec_policy_file``, real
containers (runc: the policy is the gateway's, whatever runtime is behind it), the session API, the shell endpoint, the Jupyter websocket and the
Claude loop (the real ``anthropic`` SDK against the local scripted Messages API server).

Each built-in rule is run with each action: three gateways, whose policies rotate the
actions over the rules, so every rule is denied on one, warned on another and allowed on the third.
A denied cell never reaches the kernel (the names it would set stay unset); a warned one runs
and carries its finding in the reply and in its transcript cell. The rules themselves (what each
matches) are tested without Docker in tests/test_policy.py.
"""

from __future__ import annotations

import anthropic
import nbformat
import pytest

from sandkernel.agent.client import AsyncSandkernel
from sandkernel.agent.loop import AgentConfig
from sandkernel.agent.offline_api import ScriptedMessagesServer
from sandkernel.agent.runner import run_task
from sandkernel.agent.scenarios import POLICY_FILES, SCENARIOS
from sandkernel.errors import ConfigError
from sandkernel.kernels.policy import RULE_NAMES

from .conftest import DOOR_RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import ALICE, running_gateway, start_gateway
from .test_gateway import connect, ws_execute

pytestmark = pytest.mark.docker

ACTIONS = ("deny", "warn", "allow")
# Per rule: a cell that breaks only that rule, on the line given, runs quickly in a sandbox
# without network, and sets ran_<rule> last, so a test can tell whether it ran.
CELLS: dict[str, tuple[str, int | None]] = {
    "subprocess": ("import subprocess\nout = subprocess.run(['true'])", 1),
    "os_system": ("import os\nos.system('true')", 2),
    "raw_socket": ("import socket\na, b = socket.socketpair()", 1),
    "ctypes": ("import ctypes\nsize = ctypes.sizeof(ctypes.c_int)", 1),
    "write_outside_workspace": ("try:\n    open('/etc/sandkernel-policy-test', 'w')\nexcept OSError:\n    pass", 2),
    "path_traversal": ("import os\nexists = os.path.exists('../workspace')", 2),
    "shell": ("x = 1\n!true", 2),
    "dynamic_code": ("value = eval('1 + 1')", 1),
    "package_install": ("%pip uninstall -y sandkernel-not-installed-anywhere", 1),
    # Over the 64 KiB the review reads: the finding is about the whole cell (no line).
    "unreviewed": ("pad = 0\n" * 9000, None),
}
ROTATIONS = (0, 1, 2)


def actions_for(rotation: int) -> dict[str, str]:
    return {rule: ACTIONS[(index + rotation) % 3] for index, rule in enumerate(RULE_NAMES)}


def policy_toml(rotation: int) -> str:
    lines = ['default = "allow"', "entry_points = false", "[rules]"]
    lines += [f'{rule} = "{action}"' for rule, action in actions_for(rotation).items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((runtime.values[0], rotation), marks=runtime.marks, id=f"{runtime.values[0]}-rotation{rotation}")
        for runtime in DOOR_RUNTIME_PARAMS
        for rotation in ROTATIONS
    ],
)
async def gw(request, tmp_path_factory):
    runtime, rotation = request.param
    require_runtime(runtime)
    directory = tmp_path_factory.mktemp("policy-doors")
    policy = directory / "exec-policy.toml"
    policy.write_text(policy_toml(rotation))
    async with running_gateway(directory, exec_policy_file=policy) as gateway:
        gateway.runtime, gateway.actions = runtime, actions_for(rotation)
        yield gateway


@pytest.fixture
async def gateway_session(gw):
    """A session made through the gateway's API on ``gw``: its JSON model (``id``, ``kernel``, ...)."""
    status, body = await gw.request("POST", "/api/sessions", {"limits": {"runtime": gw.runtime}})
    assert status == 201, body
    yield body
    await gw.request("DELETE", f"/api/sessions/{body['id']}")


def marked(rule: str) -> str:
    code, _ = CELLS[rule]
    return f"{code}\nran_{rule} = True"


async def code_cells(gw, session) -> list[dict]:
    status, notebook = await gw.request("GET", f"/api/sessions/{session['id']}/notebook")
    assert status == 200
    nbformat.validate(nbformat.from_dict(notebook))
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


async def test_every_rule_and_action_through_the_session_api(gw, gateway_session):
    sid = gateway_session["id"]
    replies = {}
    for rule in RULE_NAMES:
        status, reply = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": marked(rule)})
        assert status == 200, reply
        replies[rule] = reply
    for rule, action in gw.actions.items():
        reply, line = replies[rule], CELLS[rule][1]
        if action == "deny":
            assert reply["status"] == "refused", (rule, reply)
            assert reply["refusal"]["by"] == "policy" and reply["refusal"]["rule"] == rule
            assert f"rule {rule}{f', line {line}' if line else ''}" in reply["refusal"]["message"]
            assert reply["error"]["name"] == "ExecutionRefused" and reply["execution_count"] is None
            assert "Rewrite" in reply["error"]["value"]
            first = reply["policy"][0]
            assert (first["rule"], first["action"], first["line"]) == (rule, "deny", line)
        elif action == "warn":
            assert reply["status"] == "ok", (rule, reply)
            assert reply["refusal"] is None
            assert [(f["rule"], f["action"]) for f in reply["policy"]] and all(
                (f["rule"], f["action"]) == (rule, "warn") for f in reply["policy"]
            ), reply["policy"]
            assert reply["policy"][0]["line"] == line
        else:
            assert reply["status"] == "ok" and reply["policy"] == [] and reply["refusal"] is None, (rule, reply)
    # Nothing of a denied cell ran: exactly the warned and allowed cells set their names.
    _, reply = await gw.request(
        "POST", f"/api/sessions/{sid}/execute", {"code": "print(sorted(n for n in globals() if n.startswith('ran_')))"}
    )
    ran = sorted(f"ran_{rule}" for rule, action in gw.actions.items() if action != "deny")
    assert reply["text"].strip() == str(ran)
    # The transcript: a refused cell records the refusal (and no count), a warned one its finding.
    cells = {cell["source"]: cell for cell in await code_cells(gw, gateway_session)}
    for rule, action in gw.actions.items():
        meta = cells[marked(rule)]["metadata"]["sandkernel"]
        if action == "deny":
            assert meta["status"] == "refused" and meta["refusal"]["rule"] == rule
            assert cells[marked(rule)]["execution_count"] is None
        elif action == "warn":
            assert meta["status"] == "ok" and meta["policy"][0]["rule"] == rule
        else:
            assert "policy" not in meta and "refusal" not in meta


async def test_the_shell_endpoint_is_reviewed_by_its_command(gw, gateway_session):
    sid = gateway_session["id"]
    status, reply = await gw.request(
        "POST", f"/api/sessions/{sid}/shell", {"command": "echo policy > /etc/sandkernel-policy-test"}
    )
    assert status == 200, reply
    rules = ("shell", "write_outside_workspace")  # the door itself, and what the command writes
    assert {f["rule"]: f["action"] for f in reply["policy"]} == {
        r: gw.actions[r] for r in rules if gw.actions[r] != "allow"
    }
    denied = [rule for rule in rules if gw.actions[rule] == "deny"]
    if denied:
        assert reply["refusal"]["rule"] == denied[0] and reply["exit_code"] is None
        assert f"rule {denied[0]}" in reply["output"]
    else:
        assert reply["refusal"] is None and reply["exit_code"] not in (0, None)  # it ran: the sandbox said no


async def test_the_websocket_gets_a_refusal_as_a_kernel_error(gw, gateway_session):
    denied = next(rule for rule, action in gw.actions.items() if action == "deny")
    warned = next(rule for rule, action in gw.actions.items() if action == "warn")
    ws = await connect(gw, gateway_session["kernel"]["id"])
    try:
        iopub, reply = await ws_execute(ws, marked(denied))
        kinds = [(m["msg_type"], m["content"].get("execution_state")) for m in iopub]
        assert kinds == [("status", "busy"), ("error", None), ("status", "idle")], kinds
        error = iopub[1]["content"]
        assert error["ename"] == "ExecutionRefused" and f"rule {denied}" in error["evalue"]
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "ExecutionRefused"
        assert reply["content"]["traceback"] and f"rule {denied}" in reply["content"]["traceback"][0]
        # A warned cell runs as usual on the same connection; the denied one left nothing behind.
        iopub, reply = await ws_execute(ws, marked(warned))
        assert reply["content"]["status"] == "ok"
        _, reply = await ws_execute(ws, f"assert 'ran_{denied}' not in globals() and ran_{warned}")
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        ws.close()
    cells = {cell["source"]: cell for cell in await code_cells(gw, gateway_session)}
    assert cells[marked(denied)]["metadata"]["sandkernel"]["status"] == "refused"
    assert cells[marked(denied)]["metadata"]["sandkernel"]["source"] == "websocket"


# -- a policy file with a mistake, and the agent ------------------------------------------------


@pytest.mark.parametrize("runtime", DOOR_RUNTIME_PARAMS)
async def test_a_policy_file_with_a_mistake_stops_the_gateway_naming_the_line(tmp_path, runtime):
    require_runtime(runtime)
    policy = tmp_path / "exec-policy.toml"
    policy.write_text('default = "warn"\n\n[rules.subprocess]\naction = "forbid"\n')
    with pytest.raises(ConfigError, match=rf"{policy}, line 4: rules.subprocess.action must be one of"):
        await start_gateway(tmp_path, exec_policy_file=policy, default_runtime=runtime)


@pytest.fixture(scope="module", params=DOOR_RUNTIME_PARAMS)
async def agent_gateway(request, tmp_path_factory):
    require_runtime(request.param)
    directory = tmp_path_factory.mktemp("policy-agent")
    policy = directory / "exec-policy.toml"
    policy.write_text(SCENARIOS["policy"].exec_policy or "")
    async with running_gateway(directory, exec_policy_file=policy, default_runtime=request.param) as gateway:
        yield gateway


async def test_the_agent_rewrites_code_the_policy_refused(agent_gateway, tmp_path):
    scenario = SCENARIOS["policy"]
    files = scenario.make_files(tmp_path)
    async with (
        AsyncSandkernel(agent_gateway.url, ALICE) as sandkernel,
        ScriptedMessagesServer(scenario.turns()) as server,
    ):
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        outcome = await run_task(
            scenario.task,
            sandkernel,
            model,
            files=files,
            config=AgentConfig(),
            notebook_path=tmp_path / "policy.ipynb",
            download=["line_counts.csv"],
            download_to=tmp_path,
        )
    run = outcome.run
    assert run.stop == "answer", run
    assert [call.status for call in run.tool_calls] == ["refused", "ok"]
    # The refusal went back to the model as an error result, the policy's message first.
    refused = server.requests[1]["messages"][-1]["content"][0]
    assert refused["is_error"] is True
    text = refused["content"][0]["text"]
    assert text.startswith("The sandbox's code policy refused this code") and "rule subprocess, line 1" in text
    lines = (tmp_path / "line_counts.csv").read_text().splitlines()
    assert lines[1:] == [f"{name},{count}" for name, count in POLICY_FILES.items()]
    nb = nbformat.read(outcome.notebook_path, as_version=4)
    nbformat.validate(nb)
    statuses = [c.metadata["sandkernel"]["status"] for c in nb.cells if c.cell_type == "code"]
    assert statuses == ["refused", "ok"]
