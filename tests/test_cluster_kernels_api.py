"""The Jupyter kernels API through any gateway of a cluster (issue 18, "one endpoint"): what
JupyterLab with ``--gateway-url`` pointed at any host calls.

The pure tests check the 503's sentence when no host can take a new kernel. The others run two
real ``sandkernel serve`` gateways on this machine's engine against one real PostgreSQL
(tests/test_forwarding.py's Host), with unequal capacities so placement is known: host-a holds
4 sessions, host-b 5, each tenant 3 in the whole cluster. A kernel created through host-a lands
on host-b (more room), is listed by both, runs code through a websocket opened on host-a, is
interrupted, restarted and deleted through host-a; bob sees none of it anywhere; kernel creates
count against the tenant's limit across both hosts; a real ``jupyter server --gateway-url``
pointed at host-a starts and uses a kernel placed on host-b. With its own PostgreSQL, one
gateway refuses a kernel when every host is full (saying so) and when the catalog is gone (503
cluster_unavailable), while its own kernel keeps answering.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from sandkernel.gateway.cluster.catalog import HostInfo
from sandkernel.gateway.cluster.placement import no_host_reason
from sandkernel.gateway.cluster.signing import sign

from .cluster_hosts import running_cluster
from .conftest import container_ids_of, require_runtime
from .gateway_fixtures import ALICE, BOB
from .jupyter_server import jupyter_server
from .kernel_websocket import execute_request, run_cell, wait_for_stream
from .postgres_fixtures import create_database, drop_database, postgres_server, running_postgres  # noqa: F401
from .test_cluster_membership import stop_postmaster
from .test_forwarding import CLUSTER_SECRET, Host, write_secret

KERNEL_FIELDS = {"id", "name", "last_activity", "execution_state", "connections"}


# -- why no host took a kernel (pure) ------------------------------------------------------------


def host_info(host_id: str, runtimes: tuple[str, ...], free: int = 0) -> HostInfo:
    return HostInfo(host_id, f"http://{host_id}", runtimes, 4, 4 - free, free, "up", dt.datetime.now(dt.timezone.utc))


def test_no_host_running_the_runtime_is_named_with_what_the_hosts_run() -> None:
    reason = no_host_reason("runsc", [host_info("host-a", ("runc",)), host_info("host-b", ("runc",))])
    assert "runs runsc" in reason and "host-a runs runc" in reason and "host-b runs runc" in reason, reason


def test_full_hosts_no_hosts_and_an_unreadable_catalog_each_say_so() -> None:
    full = no_host_reason("runc", [host_info("host-a", ("runc", "runsc")), host_info("host-b", ("runsc",))])
    assert "every host that runs runc is full (host-a)" in full, full
    assert "no host of the cluster is up" in no_host_reason("runc", [])
    assert "retry later" in no_host_reason("runc", None)


# -- two gateways, one catalog -------------------------------------------------------------------


async def listing(host: Host, token: str = ALICE, *, local: bool = False) -> list[dict[str, Any]]:
    """GET /api/kernels on ``host``; ``local``: signed as forwarded by a gateway, so the host
    answers with the kernels it holds itself (a forwarded request is never fanned out)."""
    headers = sign(CLUSTER_SECRET, "GET", "/api/kernels", "host-x", credential=f"token {token}") if local else None
    status, kernels, _ = await host.call("GET", "/api/kernels", token=token, headers=headers)
    assert status == 200, (host.host_id, status, kernels)
    return kernels


async def channels(host: Host, kernel_id: str, token: str = ALICE) -> WebSocketClientConnection:
    return await websocket_connect(
        HTTPRequest(
            host.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels",
            headers={"Authorization": f"token {token}"},
        )
    )


async def until(what: str, check: Any, timeout: float = 30.0) -> Any:
    """Ask ``check()`` until it returns something true (the catalog's write-behind lands)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def find(kernels: list[dict[str, Any]], kernel_id: str) -> dict[str, Any] | None:
    return next((k for k in kernels if k["id"] == kernel_id), None)


@pytest.fixture(scope="module")
async def kcluster(tmp_path_factory, request) -> AsyncIterator[tuple[Host, Host]]:
    """host-a (room for 4 sessions) and host-b (5) in one cluster; 3 sessions per tenant in all.
    Each stops with --on-exit delete."""
    require_runtime("runc")
    server_url = request.getfixturevalue("postgres_server").url()
    capacity = {
        name: ("--max-sessions-total", room, "--max-sessions", "3") for name, room in (("host-a", "4"), ("host-b", "5"))
    }
    root = tmp_path_factory.mktemp("kcluster")
    async with running_cluster(Host, root, server_url, CLUSTER_SECRET, flags=capacity) as cluster:
        a, b = cluster.hosts
        yield a, b


@pytest.fixture(scope="module")
async def kernel(kcluster: tuple[Host, Host]) -> dict[str, Any]:
    """Alice's kernel, created through host-a with the Jupyter kernels API: placed on host-b
    (more room), so every test using it goes through a gateway that does not hold it."""
    a, b = kcluster
    status, model, headers = await a.call("POST", "/api/kernels", {"name": "sandkernel-python"})
    assert status == 201, (status, model, a.serve.output[-3000:], b.serve.output[-3000:])
    assert set(model) == KERNEL_FIELDS and model["name"] == "sandkernel-python", model
    assert headers["Location"] == f"/api/kernels/{model['id']}"
    # host-b holds it, host-a does not: each host's own kernels, asked as a gateway would.
    assert [k["id"] for k in await listing(b, local=True)] == [model["id"]]
    assert await listing(a, local=True) == []
    return model


@pytest.mark.docker
async def test_a_kernel_created_through_a_lands_on_the_host_with_more_room_and_is_listed_by_both(kcluster, kernel):
    a, b = kcluster
    kid = kernel["id"]
    # A client sees it through either gateway, with the Jupyter kernel model's fields.
    for host in (a, b):
        listed = find(await listing(host), kid)
        assert listed is not None, (host.host_id, await listing(host))
        assert set(listed) == KERNEL_FIELDS and listed["name"] == "sandkernel-python", listed
        assert listed["execution_state"] in ("idle", "starting"), listed
        assert listed["last_activity"], listed
    # Its own model through the gateway that does not hold it is the owner's (forwarded).
    status, model, _ = await a.call("GET", f"/api/kernels/{kid}")
    assert status == 200 and model["id"] == kid and model["name"] == "sandkernel-python", (status, model)


@pytest.mark.docker
async def test_code_runs_through_a_websocket_on_the_gateway_that_does_not_hold_the_kernel(kcluster, kernel):
    a, _ = kcluster
    ws = await channels(a, kernel["id"])
    try:
        reply, text = await run_cell(ws, "import socket\nkept = 6 * 7\nprint(kept, socket.gethostname() != '')")
        assert reply["status"] == "ok" and text == "42 True\n", (reply, text)
    finally:
        ws.close()


@pytest.mark.docker
async def test_busy_shows_cluster_wide_and_interrupt_and_restart_through_a_reach_the_kernel(kcluster, kernel):
    a, b = kcluster
    kid = kernel["id"]
    ws = await channels(a, kid)
    try:
        msg_id = uuid.uuid4().hex
        code = "import time\nprint('started', flush=True)\nfor i in range(600): time.sleep(0.1)"
        await ws.write_message(json.dumps(execute_request(msg_id, code)))
        await wait_for_stream(ws, msg_id, "started")

        async def busy_on_a() -> bool:
            listed = find(await listing(a), kid)
            return listed is not None and listed["execution_state"] == "busy"

        await until("host-a to list host-b's kernel busy (from the catalog)", busy_on_a)
        status, _, _ = await a.call("POST", f"/api/kernels/{kid}/interrupt")
        assert status == 204
        reply, _ = await run_cell(ws, "", msg_id)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply

        async def idle_on_a() -> bool:
            listed = find(await listing(a), kid)
            return listed is not None and listed["execution_state"] == "idle"

        await until("host-a to list the kernel idle again", idle_on_a)
    finally:
        ws.close()
    status, model, _ = await a.call("POST", f"/api/kernels/{kid}/restart")
    assert status == 200 and model["id"] == kid and model["execution_state"] == "idle", (status, model)
    ws = await channels(a, kid)
    try:
        reply, _ = await run_cell(ws, "kept")
        assert reply["status"] == "error" and reply["ename"] == "NameError", reply  # memory dropped
    finally:
        ws.close()
    assert [k["id"] for k in await listing(b, local=True)] == [kid]  # still where it was placed


@pytest.mark.docker
async def test_another_tenant_sees_none_of_it_anywhere(kcluster, kernel):
    kid = kernel["id"]
    for host in kcluster:
        assert await listing(host, BOB) == []
        for method, path in (
            ("GET", f"/api/kernels/{kid}"),
            ("POST", f"/api/kernels/{kid}/interrupt"),
            ("POST", f"/api/kernels/{kid}/restart"),
            ("DELETE", f"/api/kernels/{kid}"),
        ):
            status, answer, _ = await host.call(method, path, token=BOB)
            assert status == 404 and answer["error"] == "not_found", (host.host_id, method, path, status, answer)
        with pytest.raises(HTTPClientError) as refused:
            await channels(host, kid, BOB)
        assert refused.value.code == 404
    status, _, _ = await kcluster[1].call("GET", f"/api/kernels/{kid}")
    assert status == 200  # bob's attempts left it alone


@pytest.mark.docker
async def test_a_kernel_is_deleted_through_the_gateway_that_does_not_hold_it(kcluster, kernel):
    a, b = kcluster
    kid = kernel["id"]
    status, _, _ = await a.call("DELETE", f"/api/kernels/{kid}")
    assert status == 204
    for host in (a, b):
        assert find(await listing(host), kid) is None
    assert await listing(b, local=True) == []
    status, answer, _ = await b.call("GET", f"/api/kernels/{kid}")
    assert status == 404, (status, answer)
    status, sessions, _ = await a.call("GET", "/api/sessions")
    assert status == 200 and sessions == [], sessions  # nothing left of it in the catalog


@pytest.mark.docker
async def test_kernel_creates_count_against_the_tenants_limit_across_the_cluster(kcluster):
    a, b = kcluster
    made: list[str] = []
    try:
        for via in (a, b, a):
            status, model, _ = await via.call("POST", "/api/kernels", {})
            assert status == 201, (via.host_id, status, model)
            made.append(model["id"])
        held = {host.host_id: [k["id"] for k in await listing(host, local=True)] for host in (a, b)}
        assert sorted(held["host-a"] + held["host-b"]) == sorted(made), held
        assert held["host-a"] and held["host-b"], f"placement did not use both hosts: {held}"
        for host in (a, b):
            assert sorted(k["id"] for k in await listing(host)) == sorted(made)
        # Each host holds fewer than 3, so only the cluster-wide count refuses the fourth.
        for via in (a, b):
            status, answer, _ = await via.call("POST", "/api/kernels", {"name": "sandkernel-python"})
            assert status == 429, (via.host_id, status, answer)
            assert "across the cluster" in answer["message"], answer
        # Another tenant's room is its own.
        status, model, _ = await b.call("POST", "/api/kernels", {}, token=BOB)
        assert status == 201, (status, model)
        status, _, _ = await a.call("DELETE", f"/api/kernels/{model['id']}", token=BOB)
        assert status == 204
    finally:
        for kid in made:  # each through host-a: the ones on host-b are forwarded there
            status, answer, _ = await a.call("DELETE", f"/api/kernels/{kid}")
            assert status == 204, (kid, status, answer)
    for host in (a, b):
        assert await listing(host) == []


@pytest.mark.docker
async def test_bad_kernel_requests_are_400_saying_what_to_send(kcluster):
    a, _ = kcluster
    status, answer, _ = await a.call("POST", "/api/kernels", {"name": "python3"})
    assert status == 400 and answer["error"] == "unknown_kernel" and "sandkernel-python" in answer["message"], answer
    status, answer, _ = await a.call("POST", "/api/kernels", raw=b"{not json")
    assert status == 400 and answer["error"] == "bad_json", answer
    for host in kcluster:
        assert await listing(host) == []


@pytest.mark.docker
async def test_jupyter_server_pointed_at_one_gateway_uses_a_kernel_placed_on_the_other(kcluster, tmp_path):
    """What JupyterLab does with ``--gateway-url`` at host-a: the kernel lands on host-b."""
    a, b = kcluster
    async with jupyter_server(a.url, tmp_path) as lab:
        status, created = await lab.call("POST", "/api/kernels", {"name": "sandkernel-python"})
        assert status == 201, (created, lab.log_tail())
        kid = created["id"]
        assert [k["id"] for k in await listing(b, local=True)] == [kid]  # placed on host-b
        status, kernels = await lab.call("GET", "/api/kernels")
        assert status == 200 and kid in [k["id"] for k in kernels], kernels
        ws = await websocket_connect(lab.websocket_request(kid, uuid.uuid4().hex))
        try:
            reply, text = await run_cell(ws, "print(sum(range(10)))")
            assert reply["status"] == "ok" and text == "45\n", (reply, text)
        finally:
            ws.close()
        status, _ = await lab.call("DELETE", f"/api/kernels/{kid}")
        assert status == 204
        for host in (a, b):
            assert await listing(host) == []


# -- a full cluster, then no catalog -------------------------------------------------------------


@pytest.mark.docker
async def test_a_full_cluster_and_a_lost_catalog_refuse_kernels_and_the_held_one_keeps_working(tmp_path: Path):
    require_runtime("runc")
    with running_postgres() as server:  # a server of this test's own: it is stopped halfway
        url = create_database(server.url())
        secret_file = write_secret(tmp_path / "cluster.secret", CLUSTER_SECRET)
        solo = Host(tmp_path, "host-solo", url, secret_file)
        solo.flags += ("--max-sessions-total", "1")
        session_ids: list[str] = []
        try:
            await solo.start()
            status, model, _ = await solo.call("POST", "/api/kernels", {})
            assert status == 201, (status, model)
            kid = model["id"]
            _, sessions, _ = await solo.call("GET", "/api/sessions")
            session_ids = [s["id"] for s in sessions if s["kernel"]["id"] == kid]
            assert len(session_ids) == 1, sessions
            status, answer, _ = await solo.call("POST", "/api/kernels", {})
            assert status == 503 and answer["error"] == "cluster_unavailable", (status, answer)
            assert "every host that runs runc is full (host-solo)" in answer["message"], answer

            stop_postmaster(server.data_dir)
            started = time.monotonic()
            status, answer, headers = await solo.call("POST", "/api/kernels", {})
            took = time.monotonic() - started
            assert status == 503 and answer["error"] == "cluster_unavailable", (status, answer)
            assert "catalog" in answer["message"] and headers.get("Retry-After"), (answer, headers)
            assert server.password not in json.dumps(answer)
            assert took < 15, f"a kernel create without the catalog took {took:.1f}s to be refused"
            # The kernel this host holds does not need the catalog.
            status, model, _ = await solo.call("GET", f"/api/kernels/{kid}")
            assert status == 200 and model["id"] == kid, (status, model)
            ws = await channels(solo, kid)
            try:
                reply, text = await run_cell(ws, "print('still here')")
                assert reply["status"] == "ok" and text == "still here\n", (reply, text)
            finally:
                ws.close()
        finally:
            if solo.serve.proc is not None and solo.serve.proc.poll() is None:
                await solo.serve.term()
            left = {sid: container_ids_of(sid) for sid in session_ids}
            assert not any(left.values()), f"containers left behind: {left}\n{solo.serve.output[-3000:]}"
