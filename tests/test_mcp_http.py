"""MCP over streamable HTTP at ``/mcp``, driven by the official ``mcp`` SDK client against a real
gateway (two tenants, real containers, runc and gVisor), in both protocol generations the client
speaks: ``legacy`` (the initialize handshake, an ``Mcp-Session-Id`` per MCP session) and
``2026-07-28`` (a self-contained POST per request). ``mode="auto"``, the client's default,
discovers the modern one (checked below), so both are what real clients send.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult

from .conftest import DOOR_RUNTIME_PARAMS, RUNTIME_PARAMS, container_ids_of, require_runtime
from .gateway_fixtures import ALICE, BOB, Gateway, gateway_fixture, start_gateway, stop_gateway

pytestmark = pytest.mark.docker

LEGACY = "legacy"
MODERN = "2026-07-28"
MODES = [LEGACY, MODERN]
FIGURE = "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"
MODERN_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": MODERN}


gateway = gateway_fixture(runtimes=DOOR_RUNTIME_PARAMS, max_sessions=6)  # the smoke test: both


@contextlib.asynccontextmanager
async def mcp_client(
    gw: Gateway, mode: str, token: str | None = ALICE, headers: dict[str, str] | None = None, terminate: bool = True
) -> AsyncIterator[Client]:
    """The SDK's own client over streamable HTTP, with the gateway token as a bearer header (what
    ``claude mcp add --transport http ... --header "Authorization: Bearer TOKEN"`` sends)."""
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    http = httpx2.AsyncClient(headers=sent, timeout=httpx2.Timeout(60, read=300))
    transport = streamable_http_client(f"{gw.url}/mcp", http_client=http, terminate_on_close=terminate)
    async with http, Client(transport, mode=mode) as client:
        yield client


def text_of(result: CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if block.type == "text")


async def run(client: Client, code: str, session_id: str | None = None) -> CallToolResult:
    arguments: dict[str, Any] = {"code": code}
    if session_id is not None:
        arguments["session_id"] = session_id
    return await client.call_tool("run_python", arguments)


def leaves(err: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    inner = getattr(err, "exceptions", None)  # BaseExceptionGroup (Python 3.11+, exceptiongroup before)
    return [leaf for one in inner for leaf in leaves(one)] if inner else [err]


def live_ids(gw: Gateway, tenant: str) -> set[str]:
    return {m.id for m in gw.server.registry.list(tenant)}


async def close_all(gw: Gateway, tenant: str, ids: set[str]) -> None:
    for sid in ids & live_ids(gw, tenant):
        await gw.server.registry.delete(tenant, sid)


# -- state, transcripts, tenants ----------------------------------------------------------------


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
@pytest.mark.parametrize("gateway", RUNTIME_PARAMS, indirect=True)
@pytest.mark.parametrize("mode", MODES)
async def test_state_is_kept_across_calls_and_recorded_as_mcp(gateway: Gateway, mode: str) -> None:
    before = live_ids(gateway, "alice")
    async with mcp_client(gateway, mode) as client:
        first = await run(client, "x = 41\nx")
        assert not first.is_error, text_of(first)
        sid = first.structured_content["session_id"]
        if mode == LEGACY:
            # the MCP session's default session: no id needed to come back to it
            second = await run(client, "x + 1")
            assert "new session" not in text_of(first)
        else:
            # nothing ties a modern call to the last one: the result names the session to pass
            assert f'session_id="{sid}"' in text_of(first)
            second = await run(client, "x + 1", session_id=sid)
            assert "new session" not in text_of(second)
            elsewhere = await run(client, "x")
            assert elsewhere.is_error and "NameError" in text_of(elsewhere)
            assert elsewhere.structured_content["session_id"] != sid
        assert not second.is_error and text_of(second) == "42"
        assert second.structured_content["session_id"] == sid
        assert second.structured_content["execution_count"] == 2
        failed = await run(client, "1 / 0", session_id=sid)
        assert failed.is_error and "Traceback" in text_of(failed) and "ZeroDivisionError" in text_of(failed)
        figure = await run(client, FIGURE, session_id=sid)
        [image] = [block for block in figure.content if block.type == "image"]
        assert image.mime_type == "image/png" and base64.b64decode(image.data).startswith(b"\x89PNG")

        notebook = await client.read_resource(f"sandkernel://sessions/{sid}/notebook")
        cells = [c for c in json.loads(notebook.contents[0].text)["cells"] if c["cell_type"] == "code"]
        assert [c["source"] for c in cells] == ["x = 41\nx", "x + 1", "1 / 0", FIGURE]
        assert {c["metadata"]["sandkernel"]["source"] for c in cells} == {"mcp"}
    await close_all(gateway, "alice", live_ids(gateway, "alice") - before)


async def test_the_client_s_default_mode_speaks_the_modern_protocol(gateway: Gateway) -> None:
    async with mcp_client(gateway, "auto") as client:
        assert client.session.protocol_version == MODERN
        assert "run_python" in {tool.name for tool in (await client.list_tools()).tools}


@pytest.mark.parametrize("mode", MODES)
async def test_another_tenant_cannot_touch_a_session(gateway: Gateway, mode: str) -> None:
    before = live_ids(gateway, "alice")
    async with mcp_client(gateway, mode) as alice, mcp_client(gateway, mode, token=BOB) as bob:
        made = await alice.call_tool("create_session", {"name": "alice's"})
        sid = made.structured_content["session_id"]
        assert not (await run(alice, "secret = 'alice-only'", session_id=sid)).is_error

        unknown = uuid.uuid4().hex
        for tool, extra in [("run_python", {"code": "secret = 'bob was here'"}), ("list_variables", {})]:
            foreign = await bob.call_tool(tool, {**extra, "session_id": sid})
            missing = await bob.call_tool(tool, {**extra, "session_id": unknown})
            assert foreign.is_error and missing.is_error
            assert text_of(foreign).replace(sid, "ID") == text_of(missing).replace(unknown, "ID")
        closing = await bob.call_tool("close_session", {"session_id": sid})
        assert closing.is_error
        listed = await bob.call_tool("list_sessions", {})
        assert sid not in text_of(listed) and sid not in json.dumps(listed.structured_content)
        with pytest.raises(MCPError):  # the resource is refused too
            await bob.read_resource(f"sandkernel://sessions/{sid}/notebook")

        assert sid in live_ids(gateway, "alice")
        kept = await run(alice, "secret", session_id=sid)
        assert text_of(kept) == "'alice-only'"
    await close_all(gateway, "alice", live_ids(gateway, "alice") - before)
    await close_all(gateway, "bob", live_ids(gateway, "bob"))


async def test_another_tenant_cannot_ride_a_legacy_mcp_session(gateway: Gateway) -> None:
    """Bob holding Alice's Mcp-Session-Id gets the SDK's 404, as for an unknown id; sent with a
    modern request (where the SDK ignores it) it does not pick Alice's default session either."""
    before = live_ids(gateway, "alice")
    async with mcp_client(gateway, LEGACY) as alice:
        assert not (await run(alice, "secret = 'alice-only'")).is_error
        (mcp_session,) = gateway.server.mcp.sessions.legacy_sessions()  # the one legacy MCP session open
        listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
        async with httpx2.AsyncClient() as raw:
            for token, session in [(BOB, mcp_session), (ALICE, uuid.uuid4().hex)]:
                answer = await raw.post(
                    f"{gateway.url}/mcp",
                    json=listing,
                    headers={**headers, "Authorization": f"Bearer {token}", "Mcp-Session-Id": session},
                )
                assert answer.status_code == 404, answer.text
        async with mcp_client(gateway, MODERN, token=BOB, headers={"Mcp-Session-Id": mcp_session}) as bob:
            probe = await run(bob, "secret")
            assert probe.is_error and "NameError" in text_of(probe)
            await close_all(gateway, "bob", {probe.structured_content["session_id"]})
        assert text_of(await run(alice, "secret")) == "'alice-only'"
    await close_all(gateway, "alice", live_ids(gateway, "alice") - before)


# -- the ends of legacy MCP sessions -------------------------------------------------------------


async def test_a_closed_legacy_mcp_session_takes_its_default_sandbox_with_it(gateway: Gateway) -> None:
    async with mcp_client(gateway, LEGACY) as client:
        default = (await run(client, "1")).structured_content["session_id"]
        made = await client.call_tool("create_session", {})
        explicit = made.structured_content["session_id"]
        assert container_ids_of(default) and container_ids_of(explicit)
    # the client's DELETE is answered once the default session is gone
    assert default not in live_ids(gateway, "alice")
    assert container_ids_of(default) == []
    # a session made with create_session is a handle of its own: it outlives the MCP session
    assert explicit in live_ids(gateway, "alice")
    await close_all(gateway, "alice", {explicit})
    assert len(gateway.server.mcp.sessions) == 0


async def test_an_abandoned_legacy_mcp_session_is_ended_when_idle(gateway: Gateway) -> None:
    """A client killed without its DELETE: the idle sweep ends the MCP session in the SDK (its id
    answers 404) and deletes its default session (no container left)."""
    sessions = gateway.server.mcp.sessions
    async with mcp_client(gateway, LEGACY, terminate=False) as client:
        default = (await run(client, "1")).structured_content["session_id"]
    ((mcp_session, legacy),) = sessions.legacy_sessions().items()
    deadline = time.monotonic() + 30
    while legacy.in_flight and time.monotonic() < deadline:  # the killed client's GET stream is seen closed
        await asyncio.sleep(0.05)
    idle = sessions.idle
    sessions.idle = 0.0  # instead of waiting for the gateway's idle timeout
    try:
        assert await sessions.sweep() == [mcp_session]
    finally:
        sessions.idle = idle
    assert default not in live_ids(gateway, "alice") and container_ids_of(default) == []
    async with httpx2.AsyncClient() as raw:
        gone = await raw.post(
            f"{gateway.url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={
                "Authorization": f"Bearer {ALICE}",
                "Accept": "application/json, text/event-stream",
                "MCP-Protocol-Version": "2025-11-25",
                "Mcp-Session-Id": mcp_session,
            },
        )
    assert gone.status_code == 404


# -- refusals -------------------------------------------------------------------------------------


async def test_no_token_or_a_wrong_one_is_refused_before_the_sdk(gateway: Gateway) -> None:
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    async with httpx2.AsyncClient() as raw:
        for method in ("POST", "GET", "DELETE"):
            for auth in ({}, {"Authorization": "Bearer not-a-token-of-anyone"}):
                answer = await raw.request(
                    method,
                    f"{gateway.url}/mcp",
                    json=listing if method == "POST" else None,
                    headers={**MODERN_HEADERS, **auth},
                )
                assert answer.status_code == 401, (method, answer.text)
                assert answer.json()["error"] == "unauthorized"
    with pytest.raises(BaseException) as refused:  # the client raises it inside its task groups
        async with mcp_client(gateway, MODERN, token=None) as client:
            await client.list_tools()
    assert any(isinstance(err, MCPError) for err in leaves(refused.value))


async def test_bad_input_gets_a_4xx_and_the_gateway_keeps_serving(gateway: Gateway) -> None:
    auth = {"Authorization": f"Bearer {ALICE}"}
    url = f"{gateway.url}/mcp"
    legacy = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(6):
            yield b"x" * (1024 * 1024)

    cases: list[tuple[str, dict[str, Any]]] = [
        ("malformed JSON, modern", {"content": b"{not json", "headers": MODERN_HEADERS}),
        ("malformed JSON, legacy", {"content": b"{not json", "headers": legacy}),
        ("deeply nested JSON", {"content": b"[" * 100_000 + b"]" * 100_000, "headers": MODERN_HEADERS}),
        ("a batch", {"json": [{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}] * 2, "headers": MODERN_HEADERS}),
        ("not an object", {"json": 42, "headers": MODERN_HEADERS}),
        ("no method", {"json": {"jsonrpc": "2.0", "id": 1}, "headers": MODERN_HEADERS}),
        ("an unknown method", {"json": {"jsonrpc": "2.0", "id": 1, "method": "nope/nope"}, "headers": legacy}),
        (
            "an unknown protocol version",
            {
                "json": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                "headers": {**MODERN_HEADERS, "MCP-Protocol-Version": "1999-01-01"},
            },
        ),
        ("a huge body", {"content": b"x" * (5 * 1024 * 1024), "headers": MODERN_HEADERS}),
        ("a huge body, chunked", {"content": chunks(), "headers": MODERN_HEADERS}),
        (
            "no Accept",
            {"json": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, "headers": {"MCP-Protocol-Version": MODERN}},
        ),
    ]
    async with httpx2.AsyncClient(timeout=60) as raw:
        for what, request in cases:
            answer = await raw.post(url, **{**request, "headers": {**request["headers"], **auth}})
            assert 400 <= answer.status_code < 500, (what, answer.status_code, answer.text[:300])
            assert "Traceback" not in answer.text, what
        for method in ("PUT", "PATCH"):
            answer = await raw.request(method, url, headers=auth)
            assert answer.status_code == 405, method
        assert (await raw.get(f"{gateway.url}/api/health")).json()["status"] == "ok"
    async with mcp_client(gateway, MODERN) as client:
        served = await run(client, "6 * 7")
        assert text_of(served).startswith("42")
        await close_all(gateway, "alice", {served.structured_content["session_id"]})


# -- the event loop ------------------------------------------------------------------------------


async def test_the_sdk_runs_on_the_gateway_loop_and_a_long_call_blocks_nothing(gateway: Gateway) -> None:
    assert gateway.server.mcp._runner.get_loop() is asyncio.get_running_loop()
    async with mcp_client(gateway, MODERN) as client:
        sid = (await run(client, "import time")).structured_content["session_id"]
        # The call runs until the test uploads ``go``: whatever the machine's load, the health
        # answer below came while it ran (a loop the SDK blocked could not answer before it ends).
        waits = "import os\nwhile not os.path.exists('go'):\n    time.sleep(0.05)\n'slept'"
        long_call = asyncio.create_task(run(client, waits, session_id=sid))
        while not gateway.server.registry.get("alice", sid).session.busy:
            await asyncio.sleep(0.05)
        async with httpx2.AsyncClient() as raw:
            health = await raw.get(f"{gateway.url}/api/health", timeout=60)
        assert health.status_code == 200 and not long_call.done()
        status, _ = await gateway.request("PUT", f"/api/sessions/{sid}/files/go", raw=b"")
        assert status in (200, 201), status
        assert text_of(await long_call) == "'slept'"
    await close_all(gateway, "alice", {sid})


# -- the gateway's lifecycle ---------------------------------------------------------------------


@pytest.mark.parametrize("runtime", DOOR_RUNTIME_PARAMS)
async def test_a_gateway_stops_promptly_under_open_mcp_sessions(tmp_path, runtime: str) -> None:
    """The SDK's session manager stops with the gateway: an open legacy MCP session (with its
    server-to-client GET stream) and a modern client do not hold the stop up, and no container
    is left behind."""
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime)
    try:
        async with mcp_client(gw, LEGACY, terminate=False) as legacy, mcp_client(gw, MODERN) as modern:
            default = (await run(legacy, "1")).structured_content["session_id"]
            other = (await run(modern, "2")).structured_content["session_id"]
            assert len(gw.server.mcp.sessions) == 1
            started = time.monotonic()
            await stop_gateway(gw)
            took = time.monotonic() - started
    finally:
        await stop_gateway(gw)  # a second stop does nothing
    assert took < 30, f"the gateway took {took:.1f}s to stop"
    assert container_ids_of(default) == [] and container_ids_of(other) == []


@pytest.mark.parametrize("mode", MODES)
async def test_a_client_that_goes_away_mid_call_is_no_error(
    gateway: Gateway, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that gives up on a running call: the gateway logs no error, and the session
    answers the next call."""
    async with mcp_client(gateway, MODERN) as client:
        sid = (await run(client, "import time")).structured_content["session_id"]
    with caplog.at_level(logging.ERROR):
        with pytest.raises(BaseException):  # noqa: B017 (the client's own give-up, in task groups)
            async with mcp_client(gateway, mode) as client:
                await asyncio.wait_for(run(client, "time.sleep(3); 'slept'", session_id=sid), 1.0)
        async with mcp_client(gateway, MODERN) as client:
            after = await run(client, "'still here'", session_id=sid)
    assert text_of(after) == "'still here'"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    await close_all(gateway, "alice", {sid})


# -- without the extra ---------------------------------------------------------------------------

WITHOUT_MCP = """
import asyncio, importlib.abc, json, sys, tempfile, urllib.request, urllib.error
from pathlib import Path

class HideMcp(importlib.abc.MetaPathFinder):  # as if `pip install sandkernel` had no [mcp]
    def find_spec(self, name, path=None, target=None):
        if name == "mcp" or name.startswith(("mcp.", "mcp_types")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideMcp())
from sandkernel.gateway.server import Gateway
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.local_gateway import free_port

async def main():
    with tempfile.TemporaryDirectory() as state:
        settings = GatewaySettings(ip="127.0.0.1", port=free_port(), token="t" * 32, pool_size=0,
                                   state_dir=Path(state), on_exit="delete")
        async with await Gateway.start(settings) as gateway:
            def get(path):
                request = urllib.request.Request(gateway.url + path, headers={"Authorization": "token " + "t" * 32})
                try:
                    return urllib.request.urlopen(request).status
                except urllib.error.HTTPError as err:
                    return err.code
            print(json.dumps({"health": await asyncio.to_thread(get, "/api/health"),
                              "mcp": await asyncio.to_thread(get, "/mcp"),
                              "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "mcp")}))

asyncio.run(main())
"""


async def test_the_gateway_serves_without_the_mcp_extra() -> None:
    """``/mcp`` is an optional extra: without the SDK the gateway starts, and /mcp is a 404."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WITHOUT_MCP, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0, err.decode()[-2000:]
    assert json.loads(out.decode().strip().splitlines()[-1]) == {"health": 200, "mcp": 404, "loaded": []}
