"""Gateways of a cluster register in the shared PostgreSQL catalog, heartbeat, and mark a host
that stopped answering down, its live sessions ``lost`` with the reason (issue 18).

Real parts only: ``sandkernel serve`` processes on this machine's Docker engine and a throwaway
PostgreSQL server (tests/postgres_fixtures.py). Heartbeats are fast here (0.5 s, down after
3 s) so the test waits seconds, not the production defaults' 20.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import nbformat
import psycopg
import pytest

from sandkernel.kernels.lifecycle.reaper import reap_sync

from .conftest import container_ids_of
from .gateway_fixtures import BOB
from .postgres_fixtures import create_database, running_postgres
from .test_durable_sessions import Serve, clean_up

pytestmark = pytest.mark.docker

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


async def clean_up_hosts(*held: tuple[Serve, list[str]]) -> None:
    """Each gateway the test started, in order: reap what it holds and check that the sessions
    it was given are gone (tests/test_durable_sessions.py's clean_up). Without the cluster flags
    the state dir's own catalog holds nothing, so the clean-up gateway reaps every container of
    the test's (their owners are gone). A gateway never started has nothing to reap."""
    for serve, session_ids in held:
        if serve.proc is not None:
            await clean_up(serve, session_ids)


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

        # No gateway holds it now; any gateway answers for it from the catalog: lost, with why.
        status, model = await a.call("GET", f"/api/sessions/{held['id']}")
        assert status == 200 and model["state"] == "lost" and "host-b" in model["lost_reason"], (status, model)
        status, body = await a.call("POST", f"/api/sessions/{held['id']}/execute", {"code": "print(x)"})
        assert status == 410 and body["error"] == "sandbox_lost" and "host-b" in body["message"], (status, body)
        status, _ = await a.call("GET", f"/api/sessions/{held['id']}", token=BOB)
        assert status == 404  # another tenant's lost session is as unknown as any other
        status, _ = await a.call("DELETE", f"/api/sessions/{held['id']}")  # its tenant clears it
        assert status == 204 and not rows(url, "SELECT 1 FROM sandboxes WHERE session_id = %s", held["id"])
        status, _ = await a.call("GET", f"/api/sessions/{held['id']}")
        assert status == 404

        # The killed host comes back: up again, with no record of the deleted session, so what
        # was left of its sandbox is reaped at start-up.
        await b.start(*cluster_flags(tmp_path, url, "host-b", b))
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-b'") == [("up",)]
        assert not container_ids_of(held["id"])
        status, _ = await b.call("GET", f"/api/sessions/{held['id']}")
        assert status == 404
    finally:
        await clean_up_hosts((b, ids[:1]), (a, ids[1:]))


async def test_a_gateway_that_stops_says_so_and_keeps_its_sessions_through_a_slow_restart(tmp_path, fresh_postgres_url):
    url = fresh_postgres_url
    a, b = Serve(tmp_path / "a", "runc"), Serve(tmp_path / "b", "runc")
    ids: list[str] = []
    try:
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))
        session = await a.create()
        ids.append(session["id"])
        await b.start(*cluster_flags(tmp_path, url, "host-b", b))  # it would mark a crashed host down
        assert await a.term() == 0
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-a'") == [("stopping",)]
        # Longer than --host-down-after: a host that said it is restarting is given its grace
        # (an upgrade pulling an image takes time); a crashed one is not (the test above).
        await asyncio.sleep(float(DOWN_AFTER) + 3 * float(HEARTBEAT) + 1)
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-a'") == [("stopping",)]
        assert rows(url, "SELECT state FROM sandboxes WHERE session_id = %s", session["id"]) == [("running",)]
        # Any other reaper on the engine meanwhile (`sandkernel reap`, another gateway starting)
        # finds the sandbox's owner dead and no SQLite record of it: it must still keep it.
        await asyncio.to_thread(reap_sync)
        assert container_ids_of(session["id"]), "a reaper removed a stopped cluster gateway's sandbox"
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))  # durable sessions: adopted back
        assert rows(url, "SELECT status FROM hosts WHERE host_id = 'host-a'") == [("up",)]
        assert (await a.execute(session["id"], "print('kept')"))["text"] == "kept\n"
    finally:
        await clean_up_hosts((a, ids), (b, []))


async def test_a_host_that_was_cut_off_lets_go_of_the_sessions_the_cluster_declared_lost(tmp_path, fresh_postgres_url):
    url = fresh_postgres_url
    a, b = Serve(tmp_path / "a", "runc"), Serve(tmp_path / "b", "runc")
    ids: list[str] = []
    try:
        await b.start(*cluster_flags(tmp_path, url, "host-b", b))
        held = await b.create()
        ids.append(held["id"])
        await a.start(*cluster_flags(tmp_path, url, "host-a", a))
        assert b.proc is not None
        b.proc.send_signal(signal.SIGSTOP)  # frozen: no heartbeat, as if cut off from the catalog
        try:
            await until(
                "host-b marked down",
                lambda: rows(url, "SELECT 1 FROM hosts WHERE host_id = 'host-b' AND status = 'down'"),
            )
        finally:
            b.proc.send_signal(signal.SIGCONT)
        # Its tenant was told the session is lost; the host that comes back agrees, and removes it.
        await until(
            "host-b up again", lambda: rows(url, "SELECT 1 FROM hosts WHERE host_id = 'host-b' AND status = 'up'")
        )
        await until("the sandbox removed", lambda: not container_ids_of(held["id"]))
        status, body = await b.call("POST", f"/api/sessions/{held['id']}/execute", {"code": "1"})
        assert status == 410 and "host-b" in body["message"], (status, body)
        await b.flushed(held["id"])
        assert "declared it lost" in json.dumps(nbformat.read(held["path"], as_version=4).cells)
    finally:
        await clean_up_hosts((b, ids), (a, []))


async def test_losing_the_catalog_refuses_creates_fast_and_local_sessions_keep_working(tmp_path):
    with running_postgres() as server:  # a server of this test's own: it is stopped halfway
        url = create_database(server.url())
        a = Serve(tmp_path / "a", "runc")
        ids: list[str] = []
        try:
            await a.start(*cluster_flags(tmp_path, url, "host-a", a))
            session = await a.create()
            ids.append(session["id"])
            assert (await a.execute(session["id"], "x = 6 * 7"))["status"] == "ok"

            stop_postmaster(server.data_dir)
            started = time.monotonic()
            status, body = await a.call("POST", "/api/sessions", {})
            took = time.monotonic() - started
            assert status == 503 and body["error"] == "cluster_unavailable", (status, body)
            assert "s3cr3t" not in json.dumps(body) and server.password not in json.dumps(body)
            assert took < 15, f"a create without the catalog took {took:.1f}s to be refused"
            # This host's own sessions do not need the catalog: they run, and say so.
            result = await a.execute(session["id"], "print(x)")
            assert result["status"] == "ok" and result["text"] == "42\n", result
            status, model = await a.call("GET", f"/api/sessions/{session['id']}")
            assert status == 200 and model["id"] == session["id"], (status, model)
            assert a.proc is not None and a.proc.poll() is None  # the gateway is still up
        finally:
            await clean_up_hosts((a, ids))


def stop_postmaster(data_dir: Path) -> None:
    """Stop the test's PostgreSQL the way a crash of its host would look to a client: every
    connection ends (SIGINT: PostgreSQL's fast shutdown), then wait until it is gone."""
    pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"PostgreSQL (pid {pid}) did not stop")
