"""The client and a gateway that cannot start sandboxes for a while: the start breaker's
``503 sandbox_engine_unavailable`` says nothing was started, so creating a session is retried,
no sooner than the ``Retry-After`` the gateway sent (a real HTTP server on loopback, no Docker)."""

from __future__ import annotations

import json
import time

import pytest
from tornado import httpserver, web

from sandkernel.agent import AsyncSandkernel, GatewayError
from sandkernel.agent.client import MAX_RETRY_AFTER, retry_after

from .gateway_fixtures import free_port


class FlakyEngine(web.RequestHandler):
    """POST /api/sessions: refused ``refusals`` times (Retry-After 1), then created."""

    def initialize(self, state: dict) -> None:
        self.state = state

    def post(self) -> None:
        self.state["calls"].append(time.monotonic())
        if len(self.state["calls"]) <= self.state["refusals"]:
            self.set_status(503)
            self.set_header("Retry-After", "1")
            self.finish({"error": "sandbox_engine_unavailable", "message": "sandboxes cannot be started now"})
            return
        self.set_status(201)
        self.finish(json.dumps({"id": "abc123", "kernel": {"id": "k1", "name": "sandkernel-python"}}))


async def serve(refusals: int) -> tuple[str, dict, httpserver.HTTPServer]:
    state: dict = {"calls": [], "refusals": refusals}
    port = free_port()
    server = httpserver.HTTPServer(web.Application([(r"/api/sessions", FlakyEngine, {"state": state})]))
    server.listen(port, "127.0.0.1")
    return f"http://127.0.0.1:{port}", state, server


async def test_a_refused_session_is_created_once_the_engine_is_back():
    url, state, server = await serve(refusals=1)
    try:
        async with AsyncSandkernel(url, "token", restart_wait=10) as client:
            session = await client.create_session()
        assert session.id == "abc123" and len(state["calls"]) == 2
        assert state["calls"][1] - state["calls"][0] >= 0.9  # waited the Retry-After, not the 0.25 s backoff
    finally:
        server.stop()


async def test_the_client_gives_up_when_the_engine_stays_away():
    url, state, server = await serve(refusals=100)
    try:
        async with AsyncSandkernel(url, "token", restart_wait=2.5) as client:
            with pytest.raises(GatewayError, match="sandboxes cannot be started now"):
                await client.create_session()
        assert 2 <= len(state["calls"]) <= 4
    finally:
        server.stop()


class Headers:
    def __init__(self, value: str | None) -> None:
        self.headers = {} if value is None else {"Retry-After": value}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, 0.0),
        ("3", 3.0),
        ("0.5", 0.5),
        ("-4", 0.0),
        ("nan", 0.0),
        ("inf", 0.0),
        ("1e9", MAX_RETRY_AFTER),
        ("Wed, 21 Oct 2026 07:28:00 GMT", 0.0),
    ],
)
def test_retry_after_is_a_bounded_hint(value, seconds):
    assert retry_after(Headers(value)) == seconds  # type: ignore[arg-type]
