"""Every door runs code through the session service, and every observer and gate is registered
in one place (issue 32, item 1).

Read from the code: the door modules (the session API, its files, the kernel API and its
websocket, MCP's tools) act on a session only through ``self.service`` (gateway/service.py):
none of them calls the kernel session, its files or its idle clock itself; and in the gateway
package only gateway/wiring.py adds an observer or a gate. A planted module shows the checks
can fail.

Watched on a real gateway (runc: the doors are the gateway's, whatever runtime is behind them):
one execute through each door (the session API whole and streamed, its shell endpoint, the
kernel websocket, MCP's run_python and run_shell over streamable HTTP) crosses
``SessionService.execute`` (or ``execute_relayed``) with that door's name, and no execute
reaches a ``KernelSession`` from anywhere but inside the service.
"""

from __future__ import annotations

import ast
import contextvars
import json
import uuid
from pathlib import Path

import pytest

from sandkernel import doors
from sandkernel.gateway.service import SessionService
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.python_syntax import parse

from .conftest import require_runtime
from .gateway_fixtures import running_gateway
from .test_gateway import connect, ws_execute

ROOT = Path(__file__).resolve().parents[1]
# What each door module must call on the service (it is that door's way in), by module.
DOORS: dict[str, set[str]] = {
    "gateway/sessions_api.py": {"execute", "shell", "interrupt", "restart"},
    "gateway/files_api.py": {"list_files", "read_file", "write_file", "variables"},
    "gateway/kernels_api.py": {"interrupt", "restart"},
    "gateway/channels.py": {"execute_relayed"},
    "gateway/mcp/tools.py": {"execute", "shell", "interrupt", "restart", "list_files", "read_file", "write_file"},
}
# Calls that act on a session below the service: a door making one goes around it.
BELOW_THE_SERVICE = frozenset(
    {"execute", "execute_relayed", "interrupt", "restart", "variables", "write_file", "touch", "read", "list"}
)
# The one call of that kind a door keeps: the websocket mirrors the kernel's own status messages
# (busy / idle of requests that are not executes, such as completions) into the kernel model.
KEPT = {("gateway/channels.py", "touch")}
# The registry is the lookup table the doors still ask (get, find, list): not a session.
ALLOWED_RECEIVERS = frozenset({"self.service", "self.registry"})
REGISTRATIONS = frozenset({"add_observer", "add_gate"})
WIRING = "gateway/wiring.py"


def _receiver(node: ast.expr) -> str:
    return ast.unparse(node)


def calls(source: str) -> list[tuple[int, str, str]]:
    """(line, receiver, method) of every method call in ``source``."""
    found = []
    for node in ast.walk(parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            found.append((node.lineno, _receiver(node.func.value), node.func.attr))
    return found


def around_the_service(module: str, source: str) -> list[str]:
    """The calls in a door module that act on a session without the service."""
    return [
        f"{module}:{line} {receiver}.{method}()"
        for line, receiver, method in calls(source)
        if method in BELOW_THE_SERVICE and receiver not in ALLOWED_RECEIVERS and (module, method) not in KEPT
    ]


def service_calls(source: str) -> set[str]:
    return {method for _, receiver, method in calls(source) if receiver == "self.service"}


def registrations_outside_the_wiring() -> list[str]:
    found = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        module = str(path.relative_to(ROOT))
        if module == WIRING:
            continue
        found += [f"{module}:{line} {method}" for line, _, method in calls(path.read_text()) if method in REGISTRATIONS]
    return found


def test_the_doors_act_on_sessions_only_through_the_service() -> None:
    for module, expected in DOORS.items():
        source = (ROOT / module).read_text()
        assert around_the_service(module, source) == [], f"{module} goes around gateway/service.py"
        assert expected <= service_calls(source), (module, expected - service_calls(source))


def test_observers_and_gates_are_registered_in_the_wiring_alone() -> None:
    assert registrations_outside_the_wiring() == []
    wiring = service_calls((ROOT / WIRING).read_text())  # (it calls no service: a sanity check of the reader)
    assert wiring == set()
    registered = {method for _, _, method in calls((ROOT / WIRING).read_text())}
    assert registered >= REGISTRATIONS


def test_the_checks_find_a_door_that_goes_around_the_service() -> None:
    planted = (
        "class Handler:\n"
        "    async def post(self, managed):\n"
        "        managed.touch()\n"
        "        await self.service.execute(managed, 'x', '1')\n"
        "        await managed.session.execute('1')\n"
        "        managed.session.add_observer(object())\n"
    )
    assert around_the_service("planted.py", planted) == [
        "planted.py:3 managed.touch()",
        "planted.py:5 managed.session.execute()",
    ]
    assert service_calls(planted) == {"execute"}
    assert [method for _, _, method in calls(planted) if method in REGISTRATIONS] == ["add_observer"]


# -- on a real gateway ---------------------------------------------------------------------------

INSIDE = contextvars.ContextVar("inside_the_service", default=False)


@pytest.mark.docker
async def test_each_door_s_execute_crosses_the_service_and_nothing_goes_around_it(tmp_path, monkeypatch) -> None:
    require_runtime("runc")
    from .test_mcp_http import mcp_client, run

    seen: list[str] = []
    around: list[str] = []

    def spy(name: str, door_at: int):
        real = getattr(SessionService, name)

        async def through(self, *args, **kwargs):
            seen.append(args[door_at])
            token = INSIDE.set(True)
            try:
                return await real(self, *args, **kwargs)
            finally:
                INSIDE.reset(token)

        monkeypatch.setattr(SessionService, name, through)

    def guard(name: str):
        real = getattr(KernelSession, name)

        async def guarded(self, *args, **kwargs):
            if not INSIDE.get():
                around.append(name)
            return await real(self, *args, **kwargs)

        monkeypatch.setattr(KernelSession, name, guarded)

    spy("execute", 1)  # (managed, door, code, ...)
    spy("execute_relayed", 1)
    guard("execute")
    guard("execute_relayed")
    async with running_gateway(tmp_path, default_runtime="runc") as gw:
        status, session = await gw.request("POST", "/api/sessions", {})
        assert status == 201, session
        sid = session["id"]
        status, reply = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": "x = 41"})
        assert status == 200 and reply["status"] == "ok", reply
        status, streamed = await gw.request(
            "POST", f"/api/sessions/{sid}/execute?stream=1", {"code": "x += 1; print(x)"}
        )
        assert status == 200 and '"42\\n"' in streamed, streamed
        status, shell = await gw.request("POST", f"/api/sessions/{sid}/shell", {"command": "echo via-shell"})
        assert status == 200 and shell["output"].strip() == "via-shell", shell
        ws = await connect(gw, session["kernel"]["id"])
        try:
            _, ws_reply = await ws_execute(ws, "print(x)")
            assert ws_reply["content"]["status"] == "ok", ws_reply
        finally:
            ws.close()
        async with mcp_client(gw, "legacy") as client:
            result = await run(client, "print(x + 1)", sid)
            assert not result.is_error and "43" in json.dumps(result.structured_content) + str(result.content)
            shell_result = await client.call_tool("run_shell", {"command": "echo mcp-shell", "session_id": sid})
            assert not shell_result.is_error, shell_result
        status, _ = await gw.request("DELETE", f"/api/sessions/{sid}")
        assert status == 204
    assert around == []
    assert seen == [
        doors.SESSION_API,
        doors.SESSION_API,
        doors.SESSION_API,  # the shell endpoint: a cell that runs the command
        doors.WEBSOCKET,
        doors.MCP,
        doors.MCP,
    ], seen
    assert uuid.UUID(sid)  # (the id the doors shared: one session, every door)
