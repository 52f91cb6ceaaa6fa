"""Floods in both directions: kernel output the gateway must not hoard (a background thread that
keeps displaying 60 MB blobs after its cell returned) and client input it must not queue without
bound (a websocket that sends large execute_requests faster than the kernel runs them).

Each attack runs against the in-process gateway of the arena, so this process's RSS is the
gateway's; the arena then proves the canary (another tenant) was not harmed.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import nbformat
import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClosedError, websocket_connect

from sandkernel.gateway.channels import MAX_PENDING_BYTES_PER_CONNECTION
from sandkernel.notebooks.recorder import MAX_TRANSCRIPT_BYTES

from ..gateway_fixtures import ALICE, PeakRss
from ..test_gateway import execute_request

pytestmark = [pytest.mark.security, pytest.mark.slow]

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
            assert started["status"] == "ok" and started["text"] == "flooding\n", started
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
