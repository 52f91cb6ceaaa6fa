"""The warm pool: a new session takes a sandbox that is already running, is never given one that
another session touched, and pooled sandboxes count toward limits and leave nothing behind."""

from __future__ import annotations

import asyncio
import datetime
import itertools
import logging
import os
import time

import nbformat
import pytest

from sandkernel.kernels.lifecycle.pool import RETRY_SECONDS, WarmPool
from sandkernel.kernels.model.profiles import resolve_profile
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label

from .conftest import RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import ALICE, BOB, start_gateway, stop_gateway

pytestmark = pytest.mark.docker


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
        pooled = {c.id for c in docker_containers()}
        code, first = await gateway.request("POST", "/api/sessions", {})
        code2, result = await gateway.request("POST", f"/api/sessions/{first['id']}/execute", {"code": "1 + 1"})
        assert code == 201 and code2 == 200 and result["outputs"][0]["data"]["text/plain"] == "2"
        # Warm: its sandbox is one that was already running, no container was started for it (how
        # much faster that is, the bench measures).
        first_containers = [c.id for c in docker_containers(first["id"])]
        assert first_containers and set(first_containers) <= pooled, (first_containers, pooled)
        assert result["execution_count"] == 1, "a pooled kernel must not have run anything before"
        nb = nbformat.read(first["path"], as_version=4)
        assert nb.metadata["sandkernel"]["warm_pool"] is True and nb.metadata["sandkernel"]["session_id"] == first["id"]
        await wait_for_pool(gateway, 2)  # refilled in the background
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


class Watch:
    """Samples, while a test runs, the most sandboxes of this test process Docker holds and the
    most the pool holds (ready and starting): the ceilings must hold at every moment, not only
    at the end."""

    def __init__(self, gateway) -> None:
        self.pool = gateway.server.registry.pool
        self.containers = self.held = 0
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Watch:
        self._tasks = [asyncio.create_task(self._docker()), asyncio.create_task(self._pool())]
        return self

    async def _docker(self) -> None:
        while True:
            self.containers = max(self.containers, len(await asyncio.to_thread(docker_containers)))
            await asyncio.sleep(0.1)

    async def _pool(self) -> None:
        while True:
            self.held = max(self.held, self.pool.held)
            await asyncio.sleep(0.01)

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def create_all(gateway, count: int, profile: str | None = None) -> list[dict]:
    """``count`` session creates at once, each then running ``1+1``; all must succeed."""

    async def one() -> dict:
        code, created = await gateway.request("POST", "/api/sessions", {"profile": profile} if profile else {})
        assert code == 201, created
        code, result = await gateway.request("POST", f"/api/sessions/{created['id']}/execute", {"code": "1 + 1"})
        assert code == 200 and result["outputs"][0]["data"]["text/plain"] == "2", result
        return created

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def test_the_pool_grows_under_a_burst_and_shrinks_back_within_its_ceilings(tmp_path):
    """A burst that drains the pool makes it grow toward pool_max (the next sessions come warm);
    a gateway at max_sessions_total takes the surplus back for sessions; once the demand window
    passes the pool is back at pool_size; at no moment are there more sandboxes than either
    ceiling allows; and the stop removes everything, starts under way included."""
    gateway = await start_gateway(
        tmp_path,
        pool_size=1,
        pool_max=3,
        pool_refills=2,
        pool_demand_window=30,
        pool_preload=(),
        max_sessions=8,
        max_sessions_total=6,
    )
    try:
        pool = gateway.server.registry.pool
        assert (pool.size, pool.max_size, pool.concurrency) == (1, 3, 2)
        await wait_for_pool(gateway, 1)
        async with Watch(gateway) as watch:
            burst = await create_all(gateway, 3)  # 1 warm, 2 cold: 3 acquires of demand
            await wait_for_pool(gateway, 3)  # grown to its ceiling: 3 sessions + 3 pooled = the total
            # A session the pool cannot serve takes the room of a surplus pooled sandbox...
            (small,) = await create_all(gateway, 1, profile="small")
            assert pool.held == 2
            # ...and one it can serve takes a pooled sandbox, grown by the burst
            (warm,) = await create_all(gateway, 1)
            assert nbformat.read(warm["path"], as_version=4).metadata["sandkernel"]["warm_pool"] is True
            assert pool.held == 1  # 5 sessions: the total leaves the pool its floor only
            code, refused = await gateway.request("POST", "/api/sessions", {"profile": "small"})
            assert code == 429 and "limit of 6 sessions" in refused["message"]
            for session in [*burst, small, warm]:
                assert (await gateway.request("DELETE", f"/api/sessions/{session['id']}"))[0] == 204
            deadline = time.monotonic() + 120
            while await pool_size(gateway) > 1 or len(await asyncio.to_thread(docker_containers)) > 1:  # demand expired
                assert time.monotonic() < deadline, "the pool did not shrink back to its floor"
                await asyncio.sleep(0.2)
        assert watch.held <= 3, f"the pool held {watch.held} sandboxes, over pool_max 3"
        assert watch.containers <= 6, f"{watch.containers} sandboxes at once, over max_sessions_total 6"
        assert pool.held == 1
        await create_all(gateway, 2)  # demand again: it grows while the stop comes
    finally:
        await stop_gateway(gateway)
    await asyncio.sleep(2)  # a container created after the stop would show up meanwhile
    assert not docker_containers(), "the pool left sandboxes behind"
    assert not list(tmp_path.rglob("*.mnt")), "a workspace disk outlived its gateway"


async def test_a_burst_of_cold_creates_all_succeed_and_leave_nothing(tmp_path):
    gateway = await start_gateway(tmp_path, pool_size=0, max_sessions=10, max_sessions_total=10)
    try:
        sessions = await create_all(gateway, 10)
        assert len({s["id"] for s in sessions}) == 10
        assert len(docker_containers()) == 10
        deleted = await asyncio.gather(*(gateway.request("DELETE", f"/api/sessions/{s['id']}") for s in sessions))
        assert [code for code, _ in deleted] == [204] * 10
        assert not docker_containers()
    finally:
        await stop_gateway(gateway)
    assert not docker_containers() and not list(tmp_path.rglob("*.mnt"))


def test_a_pool_ceiling_below_its_size_is_refused_and_pool_max_never_shrinks_the_pool():
    from sandkernel.errors import ConfigError
    from sandkernel.gateway.settings import GatewaySettings

    with pytest.raises(ConfigError, match="ceiling"):
        WarmPool(3, max_size=2)
    assert GatewaySettings(pool_size=5, pool_max=2).pool_ceiling == 5
    assert GatewaySettings(pool_refills=0).pool_refill_concurrency == (os.cpu_count() or 1)
    assert GatewaySettings(pool_refills=3).pool_refill_concurrency == 3


def engine_time(stamp: str) -> datetime.datetime:
    """Docker's RFC 3339 timestamp (nanoseconds, trailing zeros cut) as a datetime."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.datetime.fromisoformat(f"{whole}.{(fraction or '0')[:6].ljust(6, '0')}")


async def container_times(session_id: str) -> tuple[datetime.datetime, datetime.datetime]:
    """(created, started) of a session's one container, by the engine's clock."""
    (container,) = docker_containers(session_id)
    attrs = (await asyncio.to_thread(default_engine().client.containers.get, container.id)).attrs
    return engine_time(attrs["Created"]), engine_time(attrs["State"]["StartedAt"])


async def test_cold_starts_beyond_start_concurrency_wait_their_turn(tmp_path):
    """With start_concurrency 1 a burst's cold starts run one after another, first come first
    served: each sandbox's container is created only once the one before it has started (the
    engine's own timestamps), and every create of the burst still succeeds."""
    gateway = await start_gateway(tmp_path, pool_size=0, start_concurrency=1, max_sessions=4)
    try:
        assert gateway.server.registry.settings.cold_start_concurrency == 1
        sessions = await create_all(gateway, 3)
        states = sorted([await container_times(session["id"]) for session in sessions])
        for (_, started), (created_next, _) in itertools.pairwise(states):
            assert created_next > started, f"two cold starts overlapped: {states}"
    finally:
        await stop_gateway(gateway)
    assert not docker_containers()


async def test_one_tenants_cold_starts_take_turns_and_another_tenants_do_not_wait_for_them(tmp_path):
    """Issue 30: a start is CPU work outside the tenant's sandboxes (dockerd, runc), so one
    tenant's burst took the host from everyone. With tenant_start_concurrency 1, alice's three
    creates at once start one after another (the engine's own timestamps), while bob's, sent
    with them, starts beside hers: his lane is his own, and the gateway's has room."""
    gateway = await start_gateway(tmp_path, start_concurrency=8, tenant_start_concurrency=1, max_sessions=4)
    try:
        assert gateway.server.registry.settings.tenant_cold_start_concurrency == 1

        async def create(token: str) -> dict:
            code, created = await gateway.request("POST", "/api/sessions", {}, token=token)
            assert code == 201, created
            return created

        *alices, bobs = await asyncio.gather(*(create(token) for token in (ALICE, ALICE, ALICE, BOB)))
        times = sorted([await container_times(s["id"]) for s in alices])
        for (_, started), (created_next, _) in itertools.pairwise(times):
            assert created_next > started, f"two of alice's cold starts overlapped: {times}"
        bob_created, _ = await container_times(bobs["id"])
        assert bob_created < times[-1][0], f"bob's start waited for alice's burst: {bob_created} vs {times}"
    finally:
        await stop_gateway(gateway)
    assert not docker_containers()


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_growing_pool_gives_its_starts_way_to_sessions_too(runtime):
    """At the gateway's limit while the pool grows (1 ready + 2 starting, floor 1), two sessions
    that need room get it: the ready sandbox goes, and so does a start beyond the floor, which
    removes its sandbox when it ends; once the removals are done only the floor is left (before,
    only ready ones could go: the second session got a 429). Sessions that releasing cannot make
    fit are refused without taking anything from the pool."""
    from sandkernel.gateway.managed import TooManySessionsError
    from sandkernel.gateway.registry import SessionRegistry
    from sandkernel.gateway.settings import GatewaySettings

    require_runtime(runtime)
    pool = WarmPool(1, resolve_profile(None, {"runtime": runtime}), max_size=3, concurrency=2)
    limit = 3  # what the gateway leaves the pool; sessions taking room lower it
    pool.room = lambda: limit - pool.held
    try:
        pool.start()
        await pool.wait_full()
        pool._acquires.extend([time.monotonic()] * 2)  # demand (acquires would hand the ready one out)
        pool._kick()
        deadline = time.monotonic() + 5
        while pool.held < 3:
            assert time.monotonic() < deadline, "the pool did not grow"
            await asyncio.sleep(0.01)
        assert len(pool) == 1, "the starts beyond the floor ended before the test could release them"
        registry = SessionRegistry(GatewaySettings(max_sessions_total=3), pool=pool)
        pool.room = lambda: limit - pool.held  # the registry's counts no session that took room here
        small = registry.catalog.for_tenant("small", None)
        with pytest.raises(TooManySessionsError):  # 2 surplus cannot make room for 3 sessions...
            registry.check_gateway_room(3, small)
        assert pool.held == 3, "a refused session took sandboxes from the pool"  # ...so none go
        limit = 1  # two sessions take the room: the ready sandbox and a start beyond the floor go
        registry.check_gateway_room(2, small)
        assert pool.held == 1 and pool.occupying == 1
        await pool.removals_done()
        assert len(await asyncio.to_thread(docker_containers)) <= 1, "a sandbox that gave its room is still there"
        await pool.wait_full()
        await asyncio.sleep(0.5)  # a start the pool had no room for would begin meanwhile
        assert pool.held == 1 and len(await asyncio.to_thread(docker_containers)) == 1
    finally:
        await pool.close()
    assert not docker_containers()


async def test_a_start_failing_with_any_error_pauses_refills(caplog):
    """Not only a SandkernelError: an OSError or ZMQError from a start pauses refills too (it
    used to escape, and the pool started containers in a tight loop), logged with its traceback."""
    pool = WarmPool(1, preload=())
    calls = 0

    async def failing_start():  # the engine's socket going away mid-start
        nonlocal calls
        calls += 1
        raise OSError("engine socket gone")

    pool._start_one = failing_start  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="sandkernel.kernels.lifecycle.pool"):
        pool.start()
        await asyncio.sleep(min(1.0, RETRY_SECONDS / 2))
        await pool.close()
    assert calls == 1, f"{calls} starts in a second after a failure"
    (record,) = [r for r in caplog.records if "failed to start" in r.getMessage()]
    assert "engine socket gone" in record.getMessage() and record.exc_info is not None
