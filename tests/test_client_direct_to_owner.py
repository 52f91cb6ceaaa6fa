"""What the Python client does with the host an answer names (``X-Sandkernel-Host``, on by
default): it follows a host over the endpoint's own scheme only, and a host it cannot reach is
tried once, then left alone while the calls go through the endpoint.

Real HTTP servers on loopback stand in for the gateways (an endpoint that names a host, a host
that counts what reaches it, a port that accepts and hangs up); no Docker. The gateways' side (real
cluster gateways naming hosts, the client skipping the hop) is tests/test_cluster_direct_to_owner.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from tornado import httpserver, web

from sandkernel.agent import AsyncSandkernel
from sandkernel.owner_hint import HOST_HEADER

from .gateway_fixtures import ALICE, free_port

SESSION = "0123abcd"


class SessionModel(web.RequestHandler):
    """GET /api/sessions/<id>: the session's model, naming ``named`` as its host; counts calls."""

    def initialize(self, calls: list[str], named: str | None) -> None:
        self.calls, self.named = calls, named

    def get(self, session_id: str) -> None:
        self.calls.append(session_id)
        if self.named:
            self.set_header(HOST_HEADER, self.named)
        self.finish(json.dumps({"id": session_id, "kernel": {"id": "k1", "name": "sandkernel-python"}}))


@contextlib.asynccontextmanager
async def gateway(named: str | None) -> AsyncIterator[tuple[str, list[str]]]:
    """A server answering session models that name ``named`` as the host; (its URL, its calls)."""
    calls: list[str] = []
    port = free_port()
    app = web.Application([(r"/api/sessions/([^/]+)", SessionModel, {"calls": calls, "named": named})])
    server = httpserver.HTTPServer(app)
    server.listen(port, "127.0.0.1")
    try:
        yield f"http://127.0.0.1:{port}", calls
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def hangs_up() -> AsyncIterator[tuple[str, list[int]]]:
    """A port that accepts each connection and closes it unanswered (a host the client cannot
    use); (its URL, one entry per connection)."""
    accepted: list[int] = []

    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()


async def models(client: AsyncSandkernel, n: int) -> None:
    for _ in range(n):
        assert (await client.request("GET", f"/api/sessions/{SESSION}"))["id"] == SESSION


async def test_the_named_host_gets_the_sessions_later_calls_by_default_and_not_when_turned_off():
    async with gateway(None) as (host, host_calls), gateway(host) as (endpoint, endpoint_calls):
        async with AsyncSandkernel(endpoint, ALICE) as client:
            await models(client, 3)
        assert (len(endpoint_calls), len(host_calls)) == (1, 2)
        async with AsyncSandkernel(endpoint, ALICE, direct_to_owner=False) as client:
            await models(client, 3)
        assert (len(endpoint_calls), len(host_calls)) == (4, 2)


async def test_a_host_named_over_another_scheme_or_not_a_url_is_never_followed():
    async with gateway(None) as (host, host_calls):
        port = host.rsplit(":", 1)[1]
        for named in (f"https://127.0.0.1:{port}", f"ftp://127.0.0.1:{port}", "127.0.0.1:" + port, "http://"):
            async with gateway(named) as (endpoint, endpoint_calls), AsyncSandkernel(endpoint, ALICE) as client:
                await models(client, 3)
            assert len(endpoint_calls) == 3, named
        assert host_calls == []


async def test_a_host_that_cannot_be_reached_is_tried_once_and_the_calls_go_through_the_endpoint():
    async with hangs_up() as (dead, accepted), gateway(dead) as (endpoint, endpoint_calls):
        async with AsyncSandkernel(endpoint, ALICE, max_retries=3, backoff=0.01) as client:
            await models(client, 6)  # 1 to the endpoint (names the host), 1 lost there, then the endpoint
        assert len(accepted) == 1
        assert len(endpoint_calls) == 6
