"""The transcript is an audit record: code that runs without a cell of its own (silent executes,
``user_expressions``, debugger evaluations, the session API's variable listing) leaves a note,
clipped to a bounded size."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from sandkernel.gateway.ws_audit import NOTE_CODE_CHARS

from ..gateway_fixtures import ALICE
from ..test_gateway import execute_request, ws_execute

pytestmark = [pytest.mark.security, pytest.mark.docker]


async def notes(arena) -> list[str]:
    status, notebook = await arena.gateway.request("GET", f"/api/sessions/{arena.attacker['id']}/notebook")
    assert status == 200
    return [cell["source"] for cell in notebook["cells"] if cell["cell_type"] == "markdown"]


async def test_variables_listing_is_noted(arena):
    before = len(await notes(arena))
    status, listing = await arena.gateway.request("GET", f"/api/sessions/{arena.attacker['id']}/variables")
    assert status == 200 and isinstance(listing, list)
    added = (await notes(arena))[before:]
    assert any("variables were listed" in note and "user_expressions" in note for note in added), added


async def test_silent_executes_user_expressions_and_debugger_evaluations_are_noted(arena):
    kernel_id = arena.attacker["kernel"]["id"]
    url = f"ws://127.0.0.1:{arena.gateway.port}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    conn = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {ALICE}"}))
    marker = uuid.uuid4().hex
    long_code = f"hidden_{marker} = 1  # " + "p" * (3 * NOTE_CODE_CHARS) + "\nhidden_tail = 2"
    before = len(await notes(arena))
    try:
        silent = execute_request(long_code)
        silent["content"]["silent"] = True
        await conn.write_message(json.dumps(silent))
        exprs = execute_request("")
        exprs["content"]["silent"] = True
        exprs["content"]["user_expressions"] = {"peek": f"hidden_{marker} + 41"}
        await conn.write_message(json.dumps(exprs))
        _, reply = await ws_execute(conn, f"print(hidden_{marker})")  # the silent one ran first
        assert reply["content"]["status"] == "ok"
        # Last, and not waited for: an uninitialised debugger may never answer; the gateway
        # records the evaluation when it forwards it.
        debug = execute_request("")
        debug["channel"] = "control"
        debug["header"]["msg_type"] = "debug_request"
        debug["content"] = {
            "seq": 1,
            "type": "request",
            "command": "evaluate",
            "arguments": {"expression": f"eval_{marker}"},
        }
        await conn.write_message(json.dumps(debug))
    finally:
        conn.close()
    for _ in range(100):  # the debug request is recorded when it is forwarded
        added = (await notes(arena))[before:]
        if len(added) >= 3:
            break
        await asyncio.sleep(0.1)
    silent_note = next(n for n in added if "silent execute" in n)
    assert f"hidden_{marker} = 1" in silent_note and "hidden_tail = 2" in silent_note
    assert "characters of code cut here" in silent_note and "sha256" in silent_note
    assert len(silent_note) < NOTE_CODE_CHARS + 1000
    assert any("user_expressions" in n and f"peek = hidden_{marker} + 41" in n for n in added), added
    assert any("debugger `evaluate`" in n and f"eval_{marker}" in n for n in added), added
