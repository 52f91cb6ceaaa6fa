"""The warm pool: a new session takes a sandbox that is already running, is never given one that
another session touched, and pooled sandboxes count toward limits and leave nothing behind."""

from __future__ import annotations

import asyncio
import time

import nbformat

from sandkernel.kernels.lifecycle.reaper import OWNER_LABEL, owner_label
from sandkernel.kernels.sandbox.docker_engine import default_engine

from .gateway_fixtures import start_gateway, stop_gateway


def docker_containers(session_id: str | None = None):
    """This test process's sandboxes (another suite may share the engine), optionally one session's.
    Sparse: a full listing inspects each container and fails on one removed in between."""
    labels = [f"{OWNER_LABEL}={owner_label()}"] + ([f"sandkernel.session={session_id}"] if session_id else [])
    return default_engine().client.containers.list(all=True, sparse=True, filters={"label": labels})


async def pool_size(gateway) -> int:
    return (await gateway.request("GET", "/api/health"))[1]["warm_pool"]  # counts need a token


async def wait_for_pool(gateway, size: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while await pool_size(gateway) < size:
        assert time.monotonic() < deadline, "the warm pool did not fill"
        await asyncio.sleep(0.1)


async def test_sessions_come_warm_fresh_and_are_never_reused(tmp_path):
    gateway = await start_gateway(tmp_path, pool_size=2, max_sessions_total=3)
    try:
        await wait_for_pool(gateway, 2)
        started = time.monotonic()
        code, first = await gateway.request("POST", "/api/sessions", {})
        code2, result = await gateway.request("POST", f"/api/sessions/{first['id']}/execute", {"code": "1 + 1"})
        warm_seconds = time.monotonic() - started
        assert code == 201 and code2 == 200 and result["outputs"][0]["data"]["text/plain"] == "2"
        assert warm_seconds < 5  # generous: a cold start is over a second; the bench measures it properly
        assert result["execution_count"] == 1, "a pooled kernel must not have run anything before"
        nb = nbformat.read(first["path"], as_version=4)
        assert nb.metadata["sandkernel"]["warm_pool"] is True and nb.metadata["sandkernel"]["session_id"] == first["id"]
        await wait_for_pool(gateway, 2)  # refilled in the background
        first_containers = [c.id for c in docker_containers(first["id"])]
        assert (await gateway.request("DELETE", f"/api/sessions/{first['id']}"))[0] == 204
        code, second = await gateway.request("POST", "/api/sessions", {})
        assert code == 201 and second["id"] != first["id"]
        second_containers = [c.id for c in docker_containers(second["id"])]
        assert second_containers and not set(second_containers) & set(first_containers)
        assert not [c for c in docker_containers() if c.id in first_containers], "a used sandbox went back to the pool"
        # Other profiles start cold; pooled sandboxes count toward the total (1 live + 2 pooled = 3).
        code, small = await gateway.request("POST", "/api/sessions", {"profile": "small"})
        assert code == 429 and "limit of 3 sessions" in small["message"]
        await gateway.request("DELETE", f"/api/sessions/{second['id']}")
        code, small = await gateway.request("POST", "/api/sessions", {"profile": "small"})
        assert code == 201 and nbformat.read(small["path"], as_version=4).metadata["sandkernel"]["warm_pool"] is False
    finally:
        await stop_gateway(gateway)
    assert not docker_containers(), "the pool must be drained on shutdown"


async def test_a_gateway_stopping_while_its_empty_pool_refills_leaves_no_sandbox(tmp_path):
    """An empty pool is still a pool: stopping while its only sandbox was just handed out and the
    refill is starting must remove the refill's sandbox and its workspace disk (a bench run left
    one running after its process exited)."""
    gateway = await start_gateway(tmp_path, pool_size=1, max_sessions_total=3)
    try:
        await wait_for_pool(gateway, 1)
        code, _ = await gateway.request("POST", "/api/sessions", {})  # empties the pool: a refill starts
        assert code == 201 and await pool_size(gateway) == 0
    finally:
        await stop_gateway(gateway)
    await asyncio.sleep(3)  # a container created after the stop would show up meanwhile
    assert not docker_containers(), "a refill outlived its gateway"
    assert not list(tmp_path.rglob("*.mnt")), "a workspace disk outlived its gateway"
