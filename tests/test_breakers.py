"""Circuit breakers (issue 15): a session that keeps getting OOM-killed is quarantined; a Docker
engine that is down makes new sessions fail fast with 503 and Retry-After, and they start again
by themselves once it is back, while existing sessions keep working throughout.

Pure tier: the start breaker driven by real Docker calls against a stand-in dockerd on a unix
socket (tests/test_docker_restart.py's FakeDockerd: stopped, the calls fail as they do when
dockerd is away), with a clock the test moves instead of sleeping through the cooldown; the
session breaker's counting on real ExecutionResults; the Retry-After mapping.

Docker tier: through a real gateway. Three OOM kills in a row quarantine a session, the fourth
execute is refused with the reason and how to get out, another session keeps running, a restart
clears it. The engine test STOPS THE MACHINE'S DOCKERD for a few seconds (live-restore keeps
every container running; other tests' Docker calls fail meanwhile, as in test_docker_restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from types import SimpleNamespace

import docker
import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from sandkernel.errors import (
    DockerUnavailableError,
    EngineUnavailableError,
    KernelStartError,
    SessionDetachedError,
)
from sandkernel.gateway.base import error_reply, restarting_error, retry_after_of
from sandkernel.gateway.breakers import PING_TIMEOUT, PROBE_RETRY_SECONDS, SessionBreaker, StartBreaker
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus, TimeoutStep
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.docker_engine import DockerEngine
from sandkernel.kernels.sandbox.service_cpu import engine_placement

from .conftest import DOOR_RUNTIME_PARAMS, RUNTIME_PARAMS, RunscState, require_runtime, runsc_required, runsc_state
from .gateway_fixtures import ALICE, OPERATOR, start_gateway, stop_gateway
from .test_docker_restart import (
    FakeDockerd,
    docker_answers,
    dockerd_pid,
    dockerd_pidfile,
    start_dockerd,
    stop_dockerd,
)


class Clock:
    """A monotonic clock the test moves (the cooldown passes without a sleep)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def dockerd(tmp_path):
    server = FakeDockerd(tmp_path / "docker.sock")
    yield server
    with contextlib.suppress(OSError, AssertionError):
        server.stop()


def engine_on(server: FakeDockerd) -> DockerEngine:
    return DockerEngine(docker.DockerClient(base_url=f"unix://{server.path}", version="1.41", timeout=10))


def breaker_for(engine: DockerEngine, clock: Clock, metrics: GatewayMetrics | None = None, **settings) -> StartBreaker:
    options = {"start_failures": 3, "start_cooldown": 10.0, "start_slow_seconds": 30.0, **settings}
    return StartBreaker(GatewaySettings(**options), metrics, engine=engine, clock=clock)


class Starts:
    """A sandbox start that is a real Docker call (create a container) on ``engine``; counts calls."""

    def __init__(self, engine: DockerEngine) -> None:
        self.engine = engine
        self.calls = 0

    async def __call__(self) -> dict:
        self.calls += 1
        return await self.engine.run(self.engine.client.api.create_container, "sandkernel-kernel", "true")


def metric(metrics: GatewayMetrics, name: str) -> float:
    for line in metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the metrics")


# -- the start breaker ----------------------------------------------------------------------------


async def test_a_stopped_engine_opens_the_breaker_then_starts_fail_at_once_and_heal_by_themselves(dockerd):
    clock, metrics = Clock(), GatewayMetrics()
    engine = engine_on(dockerd)
    start = Starts(engine)
    breaker = breaker_for(engine, clock, metrics)
    assert (await breaker.guard(start))["Id"].startswith("POST ")  # the engine answers
    assert breaker.health() == {"state": "closed", "consecutive_failures": 0, "retry_after": 0}

    dockerd.stop()  # dockerd goes away: the socket is gone
    for n in (1, 2, 3):
        with pytest.raises(DockerUnavailableError) as caught:
            await breaker.guard(start)
        assert not isinstance(caught.value, EngineUnavailableError)  # the engine's own failure, passed on
        assert breaker.consecutive_failures == n
    assert start.calls == 4
    health = breaker.health()
    assert health["state"] == "open" and health["retry_after"] == 10 and "not answering" in health["last_failure"]
    assert metric(metrics, 'sandkernel_start_breaker_state{state="open"}') == 1.0
    assert metric(metrics, 'sandkernel_breaker_trips_total{kind="start"}') == 1.0

    # Open: refused at once, the engine is not even asked, and the answer says when to come back.
    # "At once" is shown by the event, not a clock: guard() raises on its first step, before it
    # awaits anything (no Docker call, no ping, no wait of any length).
    clock.advance(4)
    guarded = breaker.guard(start)
    try:
        with pytest.raises(EngineUnavailableError) as caught:
            guarded.send(None)
    finally:
        guarded.close()
    assert start.calls == 4
    refusal = caught.value
    assert refusal.http_status == 503 and refusal.code == "sandbox_engine_unavailable"
    assert retry_after_of(refusal) == 6 and "Existing sessions keep working" in str(refusal)
    assert metric(metrics, "sandkernel_sandbox_starts_refused_total") == 1.0

    # Half open after the cooldown: the probe pings the engine, which is still away: open again.
    clock.advance(6)
    assert breaker.health()["state"] == "half_open"
    with pytest.raises(EngineUnavailableError, match="still does not answer"):
        await breaker.guard(start)
    assert start.calls == 4 and breaker.health()["state"] == "open" and breaker.health()["retry_after"] == 10

    # dockerd is back: the next start after the cooldown is the probe, and it closes the breaker.
    dockerd.listen()
    clock.advance(10)
    assert (await breaker.guard(start))["Id"].startswith("POST ")
    assert breaker.health() == {"state": "closed", "consecutive_failures": 0, "retry_after": 0}
    assert metric(metrics, 'sandkernel_start_breaker_state{state="closed"}') == 1.0
    assert metric(metrics, 'sandkernel_breaker_trips_total{kind="start"}') == 1.0  # one trip, however long


async def test_while_the_probe_runs_other_starts_are_refused(dockerd):
    clock = Clock()
    engine = engine_on(dockerd)
    breaker = breaker_for(engine, clock, start_failures=1)
    dockerd.stop()
    with pytest.raises(DockerUnavailableError):
        await breaker.guard(Starts(engine))
    dockerd.listen()
    clock.advance(10)
    release, probing = asyncio.Event(), asyncio.Event()

    async def slow_start() -> str:
        probing.set()
        await release.wait()
        return "started"

    probe = asyncio.create_task(breaker.guard(slow_start))
    await probing.wait()
    with pytest.raises(EngineUnavailableError) as caught:
        await breaker.guard(Starts(engine))
    assert caught.value.retry_after == PROBE_RETRY_SECONDS
    release.set()
    assert await probe == "started" and breaker.health()["state"] == "closed"


async def test_a_start_that_fails_while_the_engine_answers_is_the_sandboxs_own_failure(dockerd):
    """A tenant can ask for limits its kernel cannot start under (start_timeout 1 s, cpus 0.05):
    with the engine answering promptly that must not shut new sessions out for everyone."""
    clock = Clock()
    breaker = breaker_for(engine_on(dockerd), clock)

    async def kernel_gives_up() -> None:
        clock.advance(1)
        raise KernelStartError("sandboxed kernel did not answer within 1s")

    for _ in range(5):
        with pytest.raises(KernelStartError):
            await breaker.guard(kernel_gives_up)
    assert breaker.health()["state"] == "closed" and breaker.consecutive_failures == 0

    dockerd.stop()  # the same failure with the engine gone counts
    for _ in range(3):
        with pytest.raises(KernelStartError):
            await breaker.guard(kernel_gives_up)
    assert breaker.health()["state"] == "open"
    assert "does not answer" in breaker.health()["last_failure"]


async def test_slow_starts_count_when_the_engine_is_slow_too(dockerd):
    clock = Clock()
    breaker = breaker_for(engine_on(dockerd), clock, start_slow_seconds=30.0)

    async def crawls() -> str:
        clock.advance(45)
        return "started, late"

    assert await breaker.guard(crawls) == "started, late"  # the engine answers: the sandbox was slow
    assert breaker.consecutive_failures == 0
    dockerd.stop()
    for n in (1, 2, 3):
        assert await breaker.guard(crawls) == "started, late"  # each caller still gets its session
        assert breaker.consecutive_failures == n
    assert breaker.health()["state"] == "open" and "took 45.0s" in breaker.health()["last_failure"]


async def test_starts_piling_up_on_a_hung_engine_refuse_the_next_at_once(dockerd):
    clock = Clock()
    breaker = breaker_for(engine_on(dockerd), clock, start_slow_seconds=30.0)
    hung = asyncio.Event()
    waiting = []

    async def stuck() -> None:
        waiting.append(1)
        await hung.wait()

    tasks = [asyncio.create_task(breaker.guard(stuck)) for _ in range(3)]
    while len(waiting) < 3:
        await asyncio.sleep(0)
    clock.advance(31)
    assert await breaker.guard(lambda: asyncio.sleep(0, "ok")) == "ok"  # the engine answers pings: let it
    dockerd.stop()
    with pytest.raises(EngineUnavailableError, match="piling up"):
        await breaker.guard(lambda: asyncio.sleep(0, "never"))
    hung.set()
    await asyncio.gather(*tasks)


async def test_zero_start_failures_turns_the_breaker_off(dockerd):
    engine = engine_on(dockerd)
    breaker = breaker_for(engine, Clock(), start_failures=0)
    dockerd.stop()
    for _ in range(5):
        with pytest.raises(DockerUnavailableError) as caught:
            await breaker.guard(Starts(engine))
        assert not isinstance(caught.value, EngineUnavailableError)
    assert breaker.health()["state"] == "closed"


# -- Retry-After --------------------------------------------------------------------------------


def test_errors_that_will_pass_say_when_to_retry():
    assert error_reply(EngineUnavailableError("open", retry_after=7.2))[:2] == (503, "sandbox_engine_unavailable")
    assert retry_after_of(EngineUnavailableError("open", retry_after=7.2)) == 8
    assert retry_after_of(EngineUnavailableError("open", retry_after=0.01)) == 1
    assert retry_after_of(DockerUnavailableError("restarting")) == 5
    assert retry_after_of(SessionDetachedError("restarting")) == 2 == retry_after_of(restarting_error())
    assert retry_after_of(KernelStartError("no")) is None and retry_after_of(RuntimeError("x")) is None


# -- the session breaker, on real results ---------------------------------------------------------


def result(status: ExecutionStatus, ended_by: TimeoutStep | None = None) -> ExecutionResult:
    return ExecutionResult(status, (), None, "2026-01-01T00:00:00Z", 1.0, ended_by=ended_by)


class Session:
    """What the breaker uses of a session: its id, notes, restart (recorded) and the work queued
    after an execution (run by :meth:`finish`, as KernelSession runs it once every observer has
    heard the result)."""

    def __init__(self) -> None:
        self.id = "s1"
        self.notes: list[str] = []
        self.restarts = 0
        self.restart_reasons: list[str] = []
        self.queued: list = []

    def after_execution(self, work) -> None:
        self.queued.append(work)

    async def finish(self) -> None:
        while self.queued:
            await self.queued.pop(0)()

    async def note(self, text: str) -> None:
        self.notes.append(text)

    async def restart(self, reason: str = "on request") -> None:
        self.restarts += 1
        self.restart_reasons.append(reason)


def session_breaker(**settings) -> tuple[SessionBreaker, Session, GatewayMetrics]:
    session, metrics = Session(), GatewayMetrics()
    managed = SimpleNamespace(id=session.id, session=session)
    return SessionBreaker(managed, GatewaySettings(**settings), metrics), session, metrics  # type: ignore[arg-type]


REQUEST = ExecutionRequest("x", "session_api", "", 10.0)


async def test_only_results_in_a_row_count():
    breaker, session, metrics = session_breaker(breaker_ooms=3, breaker_timeouts=2)
    oom, timeout = result(ExecutionStatus.OOM), result(ExecutionStatus.TIMEOUT, TimeoutStep.INTERRUPT)
    for r in (oom, oom, result(ExecutionStatus.ERROR), oom, oom, result(ExecutionStatus.REFUSED), timeout):
        await breaker.execution_finished(REQUEST, r)
    assert breaker.quarantined is None and (breaker.ooms, breaker.timeouts) == (2, 1)
    assert (await breaker.admit(REQUEST)).refusal is None
    await breaker.execution_finished(REQUEST, oom)
    quarantined = breaker.quarantined
    assert (
        quarantined is not None and quarantined["ooms"] == 3 and "OOM-killed 3 times in a row" in quarantined["reason"]
    )
    refusal = (await breaker.admit(REQUEST)).refusal
    assert refusal is not None and refusal["by"] == "breaker" and refusal["rule"] == "quarantine"
    assert "POST /api/sessions/s1/restart" in refusal["message"] and "did not run" in refusal["message"]
    assert session.notes and "quarantined" in session.notes[0] and session.restarts == 0
    assert metric(metrics, 'sandkernel_breaker_trips_total{kind="oom"}') == 1.0
    breaker.clear()
    assert breaker.quarantined is None and (await breaker.admit(REQUEST)).refusal is None
    await breaker.execution_finished(REQUEST, timeout)
    await breaker.execution_finished(REQUEST, timeout)
    assert breaker.quarantined is not None and "timeout 2 times" in breaker.quarantined["reason"]


async def test_zero_thresholds_never_trip():
    breaker, _, _ = session_breaker(breaker_ooms=0, breaker_timeouts=0)
    for _ in range(20):
        await breaker.execution_finished(REQUEST, result(ExecutionStatus.OOM))
        await breaker.execution_finished(REQUEST, result(ExecutionStatus.TIMEOUT, TimeoutStep.INTERRUPT))
    assert breaker.quarantined is None


async def test_the_restart_action_restarts_a_kernel_that_still_runs_and_refuses_nothing():
    breaker, session, _ = session_breaker(breaker_timeouts=2, breaker_ooms=2, breaker_action="restart")
    for _ in range(2):  # interrupted at its timeout: the kernel (and the runaway's state) still there
        await breaker.execution_finished(REQUEST, result(ExecutionStatus.TIMEOUT, TimeoutStep.INTERRUPT))
    assert session.restarts == 0, "restarted while the other observers had not heard the result yet"
    await session.finish()
    assert session.restarts == 1 and breaker.quarantined is None and breaker.timeouts == 0
    assert "circuit breaker" in session.restart_reasons[0]  # the transcript says why, not "on request"
    for _ in range(2):  # an OOM kill already restarted it: nothing more to do than say so
        await breaker.execution_finished(REQUEST, result(ExecutionStatus.OOM))
    await session.finish()
    assert session.restarts == 1 and breaker.ooms == 0 and len(session.notes) == 2
    assert (await breaker.admit(REQUEST)).refusal is None


class EventOrder(SessionObserver):
    """Records which events it hears, in order (attached after the breaker, as the catalog is)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        self.events.append(f"finished {result.status.value}")

    async def kernel_restarted(self, reason: str, container_replaced: bool) -> None:
        self.events.append("restarted")


@pytest.mark.docker
async def test_the_breaker_s_restart_comes_after_every_observer_heard_the_cell():
    """A real session: the breaker trips on a timeout that left the kernel running (interrupted);
    its restart is queued after the execution, so an observer after it hears the cell end first
    (not the restart in the middle of the cell's own event), and the next execute finds the fresh
    kernel (the variable is gone)."""
    require_runtime("runc")
    async with await KernelSession.start(overrides={"runtime": "runc"}) as session:
        breaker, order = session_breaker(breaker_timeouts=1, breaker_action="restart")[0], EventOrder()
        breaker.managed = SimpleNamespace(id=session.id, session=session)
        session.add_observer(breaker)
        session.add_observer(order)
        await session.execute("kept = 1")
        timed_out = await session.execute("import time\nwhile True: time.sleep(0.05)", timeout=1)
        assert timed_out.status is ExecutionStatus.TIMEOUT and timed_out.ended_by is TimeoutStep.INTERRUPT
        assert order.events == ["finished ok", "finished timeout", "restarted"], order.events
        after = await session.execute("print('kept' in globals())")
        assert after.status is ExecutionStatus.OK and "False" in str(after.outputs), after.outputs


# -- through a real gateway -----------------------------------------------------------------------

BOMB = "b = bytearray(2 * 1024**3)"  # far over the 256 MiB limit: OOM-killed every time


@pytest.fixture
async def gateway(tmp_path):
    """A gateway whose start breaker cools down in 1 s (the engine test waits that out)."""
    gw = await start_gateway(tmp_path, audit=False, start_cooldown=1.0, max_sessions=6)
    yield gw
    await stop_gateway(gw)


async def create(gw, runtime: str) -> dict:
    status, body = await gw.request("POST", "/api/sessions", {"limits": {"runtime": runtime, "memory_mb": 256}})
    assert status == 201, body
    return body


async def execute(gw, session: dict, code: str) -> dict:
    status, body = await gw.request("POST", f"/api/sessions/{session['id']}/execute", {"code": code, "timeout": 120})
    assert status == 200, body
    return body


def scraped(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_three_ooms_in_a_row_quarantine_the_session_and_a_restart_clears_it(gateway, runtime):
    require_runtime(runtime)
    hog, other = await asyncio.gather(create(gateway, runtime), create(gateway, runtime))
    assert hog["quarantined"] is None
    for n in (1, 2, 3):
        result = await execute(gateway, hog, BOMB)
        assert result["status"] == "oom", result
        status, model = await gateway.request("GET", f"/api/sessions/{hog['id']}")
        assert (model["quarantined"] is None) == (n < 3), model

    quarantined = model["quarantined"]
    assert quarantined["ooms"] == 3 and "OOM-killed 3 times in a row" in quarantined["reason"]
    refused = await execute(gateway, hog, "print('should not run')")
    assert refused["status"] == "refused" and refused["execution_count"] is None
    assert refused["refusal"]["by"] == "breaker" and refused["refusal"]["rule"] == "quarantine"
    message = refused["refusal"]["message"]
    assert "quarantined" in message and f"POST /api/sessions/{hog['id']}/restart" in message
    assert [(o["ename"], o["evalue"]) for o in refused["outputs"]] == [("ExecutionRefused", message)]

    assert (await execute(gateway, other, "print(6 * 7)"))["text"] == "42\n"  # its neighbour is unaffected

    status, model = await gateway.request("POST", f"/api/sessions/{hog['id']}/restart")
    assert status == 200 and model["quarantined"] is None
    back = await execute(gateway, hog, "print('back')")
    assert back["status"] == "ok" and back["text"] == "back\n"

    status, metrics = await gateway.request("GET", "/metrics", token=OPERATOR)
    assert scraped(metrics, 'sandkernel_breaker_trips_total{kind="oom"}') == 1.0
    assert scraped(metrics, 'sandkernel_refused_executions_total{by="breaker"}') == 1.0


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.exclusive  # it stops the engine every other test of a parallel run talks to
async def test_a_stopped_engine_makes_new_sessions_fail_fast_and_they_start_again_once_it_is_back(gateway):
    """STOPS THE MACHINE'S DOCKERD for a few seconds (live-restore keeps the containers)."""
    if os.geteuid() != 0 or shutil.which("dockerd") is None or (pid := dockerd_pid()) is None:
        pytest.skip(f"needs root and a dockerd to stop (its pid in {dockerd_pidfile()})")
    runtimes = ["runc"]
    if runsc_state() is RunscState.REGISTERED:
        runtimes.append("runsc")
    elif runsc_required():
        pytest.fail("runsc is required but not registered")
    existing = [await create(gateway, runtime) for runtime in runtimes]
    for session in existing:
        assert (await execute(gateway, session, "x = 41"))["status"] == "ok"
    failures = gateway.settings.start_failures

    weighed, _, _ = await asyncio.to_thread(engine_placement)
    await asyncio.to_thread(stop_dockerd, pid)
    try:
        assert not await asyncio.to_thread(docker_answers)
        answers = []
        for _ in range(failures + 2):
            began = time.monotonic()
            answers.append((*await post_session(gateway), time.monotonic() - began))
        for session in existing:  # kernels talk ZMQ, not Docker: they keep answering
            assert (await execute(gateway, session, "x + 1"))["text"] == "42\n"
        status, metrics = await gateway.request("GET", "/metrics", token=OPERATOR)
    finally:
        await asyncio.to_thread(start_dockerd, weighed)

    assert all(status == 503 and retry_after for status, _, retry_after, _ in answers), answers
    # The first ones asked the engine and got its 503; then the breaker answers without asking it.
    codes = [code for _, code, _, _ in answers]
    assert codes == ["dockerunavailable"] * failures + ["sandbox_engine_unavailable"] * 2, answers
    # Fail fast: the engine's own failures (its socket is gone) come in milliseconds; 10 s is far
    # below the 60 s start_timeout and the Docker client's 120 s that a hanging start would wait.
    assert all(seconds < 10 for *_, seconds in answers[:failures]), answers
    # The refusals never reached the engine: no start was counted after the first ones, and the
    # one wait the breaker itself may make (a probe's ping, bounded by PING_TIMEOUT) was not exceeded.
    assert scraped(metrics, "sandkernel_sandbox_start_failures_total") == failures
    assert all(seconds < PING_TIMEOUT for *_, seconds in answers[failures:]), answers
    assert scraped(metrics, 'sandkernel_start_breaker_state{state="open"}') == 1.0
    assert scraped(metrics, "sandkernel_sandbox_starts_refused_total") == 2.0

    # Back: after Retry-After, a new session starts (the probe), with no gateway restart.
    deadline = time.monotonic() + 120
    while (answer := await post_session(gateway))[0] != 201:
        status, _, retry_after = answer
        assert status == 503 and retry_after is not None, answer
        assert time.monotonic() < deadline, "new sessions did not start again within 120 s of dockerd's return"
        await asyncio.sleep(retry_after)  # as a client does
    status, metrics = await gateway.request("GET", "/metrics", token=OPERATOR)
    assert scraped(metrics, 'sandkernel_start_breaker_state{state="closed"}') == 1.0
    for session in existing:
        assert (await execute(gateway, session, "x"))["text"] == "41\n"


async def post_session(gw) -> tuple[int, str | None, int | None]:
    """POST a runc session: (status, error code or None, Retry-After seconds or None)."""
    request = HTTPRequest(
        gw.url + "/api/sessions",
        method="POST",
        body=b'{"limits": {"runtime": "runc"}}',
        headers={"Authorization": f"token {ALICE}"},
        request_timeout=300,
    )
    try:
        response = await AsyncHTTPClient().fetch(request)
    except HTTPClientError as err:
        assert err.response is not None, err
        response = err.response
    code = json.loads(response.body)["error"] if response.code >= 400 else None
    retry_after = response.headers.get("Retry-After")
    return response.code, code, int(retry_after) if retry_after is not None else None


@pytest.mark.parametrize("runtime", DOOR_RUNTIME_PARAMS)  # the gateway's record; OOMs under both above
async def test_a_quarantine_outlives_a_gateway_restart(tmp_path, runtime):
    """The catalog records the quarantine with the session: the next gateway process adopts the
    session still quarantined (a restart of the gateway is not a way around the breaker)."""
    require_runtime(runtime)
    first = await start_gateway(tmp_path, audit=False, breaker_ooms=1, on_exit="keep")
    second = None
    try:
        try:
            hog = await create(first, runtime)
            assert (await execute(first, hog, BOMB))["status"] == "oom"
            _, model = await first.request("GET", f"/api/sessions/{hog['id']}")
            assert model["quarantined"] is not None
        finally:
            await stop_gateway(first)  # on_exit keep: the sandbox stays for the next gateway
            # (on_exit delete, the test default: it adopts and removes the sandbox whatever happens)
            second = await start_gateway(tmp_path, audit=False, breaker_ooms=1)
        status, model = await second.request("GET", f"/api/sessions/{hog['id']}")
        assert status == 200 and model["quarantined"] is not None, model
        assert "OOM-killed 1 times in a row" in model["quarantined"]["reason"]
        refused = await execute(second, hog, "print('should not run')")
        assert refused["status"] == "refused" and refused["refusal"]["rule"] == "quarantine"
        status, model = await second.request("POST", f"/api/sessions/{hog['id']}/restart")
        assert status == 200 and model["quarantined"] is None
        assert (await execute(second, hog, "print('back')"))["text"] == "back\n"
    finally:
        if second is not None:
            await stop_gateway(second)  # on_exit delete (the test default): nothing left behind
