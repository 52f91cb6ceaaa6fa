"""A client of a cluster calls a session's host directly once an answer named it
(on by default: ``AsyncSandkernel(direct_to_owner=False)`` keeps to the endpoint; sandkernel/owner_hint.py), and falls back to its
endpoint when that host cannot be reached.

Real parts: two ``sandkernel serve`` in cluster mode on this machine's engine, PostgreSQL, the
real Python client.
"""

from __future__ import annotations

import pytest

from sandkernel.agent.client import AsyncSandkernel
from sandkernel.agent.errors import GatewayUnreachableError
from sandkernel.owner_hint import HOST_HEADER

from .gateway_fixtures import ALICE, call_api, free_port
from .test_cluster_membership import clean_up_hosts, cluster_flags, rows
from .test_durable_sessions import Serve

pytestmark = pytest.mark.docker


async def test_a_client_goes_straight_to_the_sessions_host_and_back_to_its_endpoint_when_that_host_moves(
    tmp_path, fresh_postgres_url
):
    url = fresh_postgres_url
    a, b = Serve(tmp_path / "a", "runc"), Serve(tmp_path / "b", "runc")
    ids: list[str] = []
    try:
        await b.start(*cluster_flags(tmp_path, url, "host-b", b))
        sid = (await b.create())["id"]  # b is the only host: the session is b's
        ids.append(sid)
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))

        # Every answer names the host that gave it; a forwarded one names the owner, not the forwarder.
        _, _, headers = await call_api(f"{a.url}/api/sessions/{sid}", "GET")
        assert headers.get_list(HOST_HEADER) == [b.url], headers.get_list(HOST_HEADER)
        _, _, headers = await call_api(f"{a.url}/api/sessions", "GET")
        assert headers.get_list(HOST_HEADER) == [a.url]

        async with (
            AsyncSandkernel(a.url, ALICE) as client,  # on by default
            AsyncSandkernel(a.url, ALICE, direct_to_owner=False, restart_wait=0, max_retries=0) as pinned,
        ):
            session = await client.get_session(sid)  # through a, which forwards to b: b named
            assert (await session.run("x = 41")).status == "ok"
            pinned_session = await pinned.get_session(sid)
            assert (await pinned_session.run("print(x)")).text == "41\n"

            # a goes away: the client's calls for the session never needed it; a client told to
            # keep to its endpoint has lost its way to the session.
            a.kill9()
            assert (await session.run("print(x + 1)")).text == "42\n"
            with pytest.raises(GatewayUnreachableError):
                await pinned_session.run("print(x)")

            # b moves (restarted on another port: the catalog has its new URL). The old address
            # refuses; the client forgets it and goes through its endpoint, which names b again.
            await a.start(*cluster_flags(tmp_path, url, "host-a", a))
            assert await b.term() == 0
            b.port = free_port()
            await b.start(*cluster_flags(tmp_path, url, "host-b", b))
            assert rows(url, "SELECT url FROM hosts WHERE host_id = 'host-b'") == [(b.url,)]
            assert (await session.run("print(x)")).text == "41\n"
            assert client._owners[sid] == b.url
    finally:
        await clean_up_hosts((b, ids), (a, []))
