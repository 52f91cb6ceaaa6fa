"""Floods in both directions: kernel output the gateway must not hoard (a background thread that
keeps displaying 60 MB blobs after its cell returned) and client input it must not queue without
bound (a websocket that sends large execute_requests faster than the kernel runs them).

Each attack runs against the in-process gateway of the arena, so this process's RSS is the
gateway's; the arena then proves the canary (another tenant) was not harmed.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import nbformat
import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClosedError, websocket_connect

from sandkernel.gateway.inflight import MAX_PENDING_BYTES_PER_CONNECTION, MAX_PENDING_BYTES_PER_TENANT
from sandkernel.kernels.execution.outputs import OVER_BUDGET
from sandkernel.notebooks.recorder import MAX_TRANSCRIPT_BYTES

from ..gateway_fixtures import ALICE, BOB, PeakRss
from ..test_gateway import execute_request, ws_execute

pytestmark = [pytest.mark.security, pytest.mark.docker, pytest.mark.slow]

# What the gateway may grow by while a kernel floods it with 60 MB messages (MiB). Without byte
# bounds it grew 2.3 GiB in 30 s (64 queued messages of 60 MB per subscriber, every output kept).
FLOOD_RSS_BOUND_MIB = 300
FLOOD_SECONDS = 25

BACKGROUND_FLOOD = f"""
import threading, time
from IPython.display import display
blob = 'x' * 60_000_000
until = time.monotonic() + {FLOOD_SECONDS}
def flood():
    while time.monotonic() < until:
        display({{'text/plain': blob}}, raw=True)
flooder = threading.Thread(target=flood, daemon=True)
flooder.start()
print('flooding')
"""


async def _execute(arena, session_id: str, code: str, timeout: float = 120) -> dict:
    status, reply = await arena.gateway.request(
        "POST", f"/api/sessions/{session_id}/execute", {"code": code, "timeout": timeout}
    )
    assert status == 200, reply
    return reply


# The output budget's marker for a display it dropped whole (sandkernel.truncation.cut_marker).
BUDGET_MARKER = re.compile(
    rf"\n…\[sandkernel: \d+ bytes of text/plain cut here \({re.escape(OVER_BUDGET)}\); sha256 [0-9a-f]{{64}}\]…\n"
)


def _without_budget_markers(text: str) -> str:
    """``text`` with the output budget's markers taken out: the flooder thread may display its
    first blob before the cell that started it went idle (a thread is not told when its cell
    ends), and the budget then replaces that blob with a marker; anything else stays."""
    return BUDGET_MARKER.sub("", text)


async def test_background_display_flood_keeps_the_gateway_bounded(arena):
    """60 MB displays keep coming after the cell returned: between executes the gateway drains
    and discards them (the transcript says how many), during an execute the output budget
    replaces them with markers, and the transcript on disk stays under its cap."""
    status, session = await arena.gateway.request("POST", "/api/sessions", {"limits": {"runtime": arena.runtime}})
    assert status == 201, session
    arena.extra_sessions.add(session["id"])
    sid = session["id"]
    try:
        async with PeakRss() as rss:
            started = await _execute(arena, sid, BACKGROUND_FLOOD)
            assert started["status"] == "ok" and _without_budget_markers(started["text"]) == "flooding\n", started
            await asyncio.sleep(8)  # no execute running: nothing may pile up in the gateway
            idle_growth = rss.peak - rss.baseline
            during = await _execute(arena, sid, "print('alive')")
            assert during["status"] == "ok" and "alive\n" in during["text"], during["status"]
            joined = await _execute(arena, sid, "flooder.join()")  # collects the rest of the flood
            assert joined["status"] == "ok", joined["status"]
        print(f"gateway growth: {idle_growth:.0f} MiB between executes, {rss.growth:.0f} MiB in all")
        assert idle_growth < FLOOD_RSS_BOUND_MIB, f"gateway grew {idle_growth:.0f} MiB between executes"
        assert rss.growth < FLOOD_RSS_BOUND_MIB, f"gateway grew {rss.growth:.0f} MiB"
        after = await _execute(arena, sid, "print(flooder.is_alive(), len(blob))")
        assert after["status"] == "ok" and after["text"] == "False 60000000\n", after
        status, _ = await arena.gateway.request("GET", f"/api/sessions/{sid}/notebook")
        assert status == 200
        path = Path(session["path"])
        assert path.stat().st_size <= MAX_TRANSCRIPT_BYTES, f"transcript is {path.stat().st_size} bytes"
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code[-1].source == "print(flooder.is_alive(), len(blob))"
        notes = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        assert "output after the cell returned" in notes, notes
    finally:
        await arena.gateway.request("DELETE", f"/api/sessions/{sid}")
        arena.extra_sessions.discard(sid)


# Inbound: large execute_requests sent while the kernel is busy, so none is answered meanwhile.
FRAME_BYTES = 4 * 1024 * 1024


def _ws_request(arena, kernel_id: str, token: str = ALICE) -> HTTPRequest:
    url = f"ws://127.0.0.1:{arena.gateway.port}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    return HTTPRequest(url, headers={"Authorization": f"token {token}"})


def _big_execute() -> str:
    """A 4 MiB execute_request (a comment: cheap to run; not kept in the kernel's history, so
    running the admitted ones afterwards does not run the attacker's own kernel out of memory)."""
    request = execute_request("#" + "x" * (FRAME_BYTES - 512))
    request["content"]["store_history"] = False
    return json.dumps(request)


async def _send_until_closed(conn, frames: int) -> None:
    """Send up to ``frames`` large execute_requests, stopping when the gateway closes the
    connection, then wait for its close frame."""
    for _ in range(frames):
        try:
            await conn.write_message(_big_execute())
        except WebSocketClosedError:
            break
    while conn.close_code is None:
        try:
            if await asyncio.wait_for(conn.read_message(), 10) is None:
                break
        except asyncio.TimeoutError:
            break


async def _connected(arena) -> object:
    """A websocket to the attacker's kernel whose output subscription is live (one round trip)."""
    conn = await websocket_connect(_ws_request(arena, arena.attacker["kernel"]["id"]))
    probe = execute_request("")
    probe["header"]["msg_type"] = "kernel_info_request"
    probe["content"] = {}
    await conn.write_message(json.dumps(probe))
    while True:
        message = json.loads(await asyncio.wait_for(conn.read_message(), 60))
        if (
            message.get("parent_header", {}).get("msg_id") == probe["header"]["msg_id"]
            and message["channel"] == "shell"
        ):
            return conn


async def _busy(arena, conn, seconds: int = 600) -> asyncio.Task:
    """Keep the attacker's kernel busy (through the session API), so requests sent meanwhile
    stay unanswered; returns once ``conn`` saw it start. End it with :func:`_interrupt`."""
    task = asyncio.create_task(arena.attack(f"import time; time.sleep({seconds})", timeout=seconds + 60))
    while True:
        message = json.loads(await asyncio.wait_for(conn.read_message(), 60))
        if message.get("msg_type") == "execute_input" and "time.sleep" in message["content"]["code"]:
            return task


async def _interrupt(arena, busy: asyncio.Task) -> None:
    """Interrupt the busy execute: the kernel then aborts the queued requests (stop_on_error)
    instead of running them, so the attacker's kernel is soon ready for the next test."""
    status, _ = await arena.gateway.request("POST", f"/api/sessions/{arena.attacker['id']}/interrupt")
    assert status in (200, 204)
    assert (await busy)["status"] in ("interrupted", "error")


async def _canary_sends_a_large_request(arena) -> None:
    """Bob (another tenant) still gets large requests through his own websocket."""
    conn = await websocket_connect(_ws_request(arena, arena.canary["kernel"]["id"], token=BOB))
    try:
        iopub, reply = await ws_execute(conn, "big = '" + "y" * FRAME_BYTES + "'\nprint(len(big))", timeout=120)
        assert reply["content"]["status"] == "ok"
        assert any(m["msg_type"] == "stream" and m["content"]["text"] == f"{FRAME_BYTES}\n" for m in iopub)
    finally:
        conn.close()
    arena.canary_cells += 1


async def test_a_websocket_flooding_requests_is_closed_at_its_in_flight_bound(arena):
    await arena.attack("print('idle')")  # earlier attacks are over
    conn = await _connected(arena)
    busy = await _busy(arena, conn)
    frames = 40  # 160 MiB, five times the bound
    try:
        async with PeakRss() as rss:
            await _send_until_closed(conn, frames)
        # Outside the RSS window: the canary's own 4 MiB request and echo are not the attacker's growth.
        await _canary_sends_a_large_request(arena)
    finally:
        await _interrupt(arena, busy)
    assert conn.close_code == 1008, f"not closed after {frames} frames of {FRAME_BYTES} bytes ({conn.close_code})"
    assert "wait for replies" in conn.close_reason, conn.close_reason
    assert rss.growth < 200, f"gateway grew {rss.growth:.0f} MiB"
    after = await arena.attack("print('after the flood')", timeout=300)
    assert after["status"] == "ok" and after["text"] == "after the flood\n", after


async def test_a_tenant_cannot_multiply_its_in_flight_bound_with_connections(arena):
    await arena.attack("print('idle')")
    per_connection = MAX_PENDING_BYTES_PER_CONNECTION // FRAME_BYTES - 1  # each connection stays under its own bound
    count = MAX_PENDING_BYTES_PER_TENANT // (per_connection * FRAME_BYTES) + 1
    conns = [await _connected(arena) for _ in range(count)]
    busy = await _busy(arena, conns[0])
    try:
        async with PeakRss() as rss:
            for conn in conns:
                for _ in range(per_connection):
                    try:
                        await conn.write_message(_big_execute())
                    except WebSocketClosedError:
                        break
            last = conns[-1]
            while last.close_code is None and await asyncio.wait_for(last.read_message(), 30) is not None:
                pass
        # Outside the RSS window: the canary's own 4 MiB request and echo are not the attacker's growth.
        await _canary_sends_a_large_request(arena)
        assert last.close_code == 1008 and "tenant" in last.close_reason, (last.close_code, last.close_reason)
        assert all(c.close_code is None for c in conns[:-1]), "connections within the bound were closed"
        assert rss.growth < 300, f"gateway grew {rss.growth:.0f} MiB"
    finally:
        await _interrupt(arena, busy)
        for conn in conns:
            conn.close()
    after = await arena.attack("print('after the flood')", timeout=300)
    assert after["status"] == "ok" and after["text"] == "after the flood\n", after
