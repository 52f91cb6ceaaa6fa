"""Gateways of a cluster register in the shared PostgreSQL catalog, heartbeat, and mark a host
that stopped answering down, its live sessions ``lost`` with the reason (issue 18).

Real parts only: ``sandkernel serve`` processes on this machine's Docker engine and a throwaway
PostgreSQL server (tests/postgres_fixtures.py). Heartbeats are fast here (0.5 s, down after
3 s) so the test waits seconds, not the production defaults' 20.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import psycopg

from .test_durable_sessions import Serve, clean_up

HEARTBEAT = "0.5"
DOWN_AFTER = "3"


def cluster_flags(tmp_path: Path, url: str, host: str, serve: Serve) -> tuple[str, ...]:
    secret = tmp_path / "cluster.secret"
    if not secret.exists():
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
    return (
        "--catalog-url", url, "--cluster-secret-file", str(secret), "--host-id", host,
        "--advertise-url", serve.url, "--heartbeat-seconds", HEARTBEAT, "--host-down-after", DOWN_AFTER,
    )  # fmt: skip


def rows(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, connect_timeout=10) as conn:
        return conn.execute(sql, params).fetchall()


async def until(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_a_killed_host_is_marked_down_by_the_others_and_its_sessions_are_lost(tmp_path, fresh_postgres_url):
    url = fresh_postgres_url
    a, b = Serve(tmp_path / "a", "runc"), Serve(tmp_path / "b", "runc")
    ids: list[str] = []
    try:
        await b.start(*cluster_flags(tmp_path, url, "host-b", b))
        held = await b.create()  # b is the only host: the session is b's
        ids.append(held["id"])
        assert (await b.execute(held["id"], "x = 41; print(x + 1)"))["text"] == "42\n"
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))
        hosts = dict((h, (s, u, r)) for h, s, u, r in rows(url, "SELECT host_id, status, url, runtimes FROM hosts"))
        assert hosts["host-a"][:2] == ("up", a.url) and hosts["host-b"][:2] == ("up", b.url), hosts
        assert "runc" in hosts["host-a"][2], hosts
        assert rows(url, "SELECT host_id, state FROM sandboxes WHERE session_id = %s", held["id"]) == [
            ("host-b", "running")
        ]

        b.kill9()  # no goodbye: only the missing heartbeats tell
        await until(
            "host-b marked down",
            lambda: rows(url, "SELECT 1 FROM hosts WHERE host_id = 'host-b' AND status = 'down'"),
        )
        ((state, reason),) = rows(url, "SELECT state, lost_reason FROM sandboxes WHERE session_id = %s", held["id"])
        assert state == "lost" and "host-b" in reason, (state, reason)
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-a'") == [("up",)]

        # The host that is left keeps serving: new sessions start and run on it.
        fresh = await a.create()
        ids.append(fresh["id"])
        assert (await a.execute(fresh["id"], "print('still here')"))["text"] == "still here\n"

        # The killed host comes back: up again, and what was declared lost stays lost (its
        # tenant was told; it is never quietly turned back), readable with the reason.
        await b.start(*cluster_flags(tmp_path, url, "host-b", b))
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-b'") == [("up",)]
        status, model = await b.call("GET", f"/api/sessions/{held['id']}")
        assert status == 200 and model["state"] == "lost" and "host-b" in model["lost_reason"], (status, model)
        status, body = await b.call("POST", f"/api/sessions/{held['id']}/execute", {"code": "print(x)"})
        assert status == 410, (status, body)
    finally:
        # Without the cluster flags the state dir's own catalog holds nothing, so the clean-up
        # gateway reaps every container of the test's (their owners are gone) and checks that.
        for serve, mine in ((b, ids[:1]), (a, ids[1:])):
            if serve.proc is not None:
                await clean_up(serve, mine)


async def test_a_gateway_that_stops_says_so_and_keeps_its_sessions(tmp_path, fresh_postgres_url):
    url = fresh_postgres_url
    a = Serve(tmp_path / "a", "runc")
    ids: list[str] = []
    try:
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))
        session = await a.create()
        ids.append(session["id"])
        assert await a.term() == 0
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-a'") == [("stopping",)]
        assert rows(url, "SELECT state FROM sandboxes WHERE session_id = %s", session["id"]) == [("running",)]
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))  # durable sessions: adopted back
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-a'") == [("up",)]
        assert (await a.execute(session["id"], "print('kept')"))["text"] == "kept\n"
    finally:
        if a.proc is not None:
            await clean_up(a, ids)
