"""Clients ride through a gateway restart (issue 13, item 6).

Real ``sandkernel serve`` processes killed with SIGKILL or stopped with SIGTERM and started again
on the same port, a real client, real containers. What must hold: an idempotent call waits for the
gateway to come back; an execute that loses its gateway raises ``GatewayRestarted`` promptly (not
when the code would have finished), never hangs and is never sent twice; the agent loop tells the
model the step may not have finished and carries on.

Faults a real gateway cannot produce on demand (a connection dropped mid-stream, a 503 that says
"not run", a sandbox lost while no gateway was attached) come from a scripted loopback listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest

from sandkernel.agent import (
    AsyncSandkernel,
    GatewayError,
    GatewayRestarted,
    GatewayUnreachableError,
    Sandkernel,
)
from sandkernel.agent.client import ENDPOINT_CONNECT_SECONDS
from sandkernel.agent.loop import AgentConfig, ClaudeAgent
from sandkernel.agent.offline_api import ScriptedMessagesServer, ScriptedTurn, call, result_contains, say
from sandkernel.agent.tools import GATEWAY_RESTARTED, RESTART_NOTE
from sandkernel.kernels.sandbox.kernelspec import kernel_name_for

from .conftest import DOOR_RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import ALICE, free_port, refusing_port
from .jupyter_server import jupyter_server

SERVE = [sys.executable, "-m", "sandkernel.cli", "serve"]


class GatewayProcess:
    """``sandkernel serve`` on one loopback port, restartable on that port with the same state."""

    def __init__(self, tmp_path: Path, runtime: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp_path = tmp_path
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({"alice": ALICE}))
        tokens.chmod(0o600)
        self.argv = [
            *SERVE,
            "--port", str(self.port),
            "--tokens-file", str(tokens),
            "--pool-size", "0",
            "--max-sessions", "4",
            "--default-runtime", runtime,
            "--notebook-dir", str(tmp_path / "notebooks"),
            "--shutdown-grace", "1",
            "--state-dir", str(tmp_path / "state"),  # where the next process finds the sessions
            *extra,
        ]  # fmt: skip
        self.runtime = runtime
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.session_ids: list[str] = []  # what the fixture cleans up

    def spawn(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "the previous gateway is still running"
        self.starts += 1
        with (self.tmp_path / f"gateway-{self.starts}.log").open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)

    async def wait_up(self, timeout: float = 90) -> None:
        async with AsyncSandkernel(self.url, ALICE) as probe:
            assert await probe.wait_until_up(timeout), f"gateway not up in {timeout} s: {self.log()[-2000:]}"

    async def start(self) -> None:
        self.spawn()
        await self.wait_up()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def log(self) -> str:
        return (self.tmp_path / f"gateway-{self.starts}.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def remove_containers_of(session_ids: list[str]) -> None:
    """Only this test's sandboxes: a killed gateway that nothing restarted leaves them running."""
    for session_id in session_ids:
        found = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=sandkernel.session={session_id}"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        if found:
            subprocess.run(["docker", "rm", "-f", *found], capture_output=True, timeout=120)


@pytest.fixture(params=DOOR_RUNTIME_PARAMS)  # the client and the gateway ride through; adoption under both: test_durable_sessions
async def gateway(request, tmp_path):
    """A restartable gateway process (named ``gateway``: the suite's tier rule makes it a docker test)."""
    require_runtime(request.param)
    gw = GatewayProcess(tmp_path, request.param)
    yield gw
    if gw.proc is not None and gw.proc.poll() is None:
        with contextlib.suppress(Exception):
            async with AsyncSandkernel(gw.url, ALICE, restart_wait=5) as sk:
                for session_id in gw.session_ids:
                    with contextlib.suppress(Exception):
                        await (await sk.get_session(session_id)).delete()
    gw.stop()
    await asyncio.to_thread(remove_containers_of, gw.session_ids)


# -- a gateway that is not there yet ----------------------------------------------------------


async def test_calls_wait_for_a_gateway_that_comes_up_on_the_same_port(gateway):
    """Connection refused, then the gateway comes up within restart_wait: a GET (async and sync)
    and a session create (refused means nothing was sent, so it is safe to send) succeed without
    the caller doing anything, and the create happened once."""
    async with AsyncSandkernel(gateway.url, ALICE, restart_wait=90) as sk:
        began = time.monotonic()
        listing = asyncio.create_task(sk.list_sessions())

        def sync_list() -> list[dict[str, Any]]:
            with Sandkernel(gateway.url, ALICE, restart_wait=90) as blocking:
                return blocking.list_sessions()

        sync_listing = asyncio.create_task(asyncio.to_thread(sync_list))
        created = asyncio.create_task(sk.create_session(profile="small"))
        await asyncio.sleep(2)
        assert not listing.done() and not sync_listing.done() and not created.done()
        gateway.spawn()
        assert isinstance(await asyncio.wait_for(listing, 120), list)  # before or after the create
        assert isinstance(await asyncio.wait_for(sync_listing, 120), list)
        session = await asyncio.wait_for(created, 180)
        gateway.session_ids.append(session.id)
        assert time.monotonic() - began > 2
        assert [s["id"] for s in await sk.list_sessions()] == [session.id]  # created exactly once
        assert (await session.run("6 * 7")).text == "42\n"


async def test_gateway_that_never_comes_back_fails_after_restart_wait():
    with refusing_port() as port:
        await _never_comes_back(port)


async def _never_comes_back(port: int) -> None:
    async with AsyncSandkernel(f"http://127.0.0.1:{port}", ALICE, restart_wait=1.5, backoff=0.1, max_backoff=0.4) as sk:
        began = time.monotonic()
        with pytest.raises(GatewayUnreachableError) as err:
            await sk.list_sessions()
        assert sk.restart_wait - sk.max_backoff < time.monotonic() - began < gave_up_by(sk)
        assert err.value.sent is False
        assert not await sk.wait_until_up(0.5)


def gave_up_by(sk: AsyncSandkernel) -> float:
    """The latest a retried call to a refusing or dropping loopback listener may fail. The client
    sleeps again only if the backoff ends before ``restart_wait``, so its last try starts by then;
    loopback refuses or drops that try at once, and the client's connect timeout is the margin
    given to it on a loaded machine. A client that kept retrying would pass this bound."""
    return sk.restart_wait + ENDPOINT_CONNECT_SECONDS


# -- faults on demand: a scripted loopback listener --------------------------------------------


class ScriptedGateway:
    """Answers /api/health with 200 and every other request from ``script`` (one entry per
    request, the last repeated): ``None`` drops the connection after reading the request; a
    tuple (status, body, content_type) answers; ``("stream", lines)`` sends NDJSON lines then
    drops. ``requests`` counts the non-health requests by path."""

    def __init__(self, script: list[Any], health: list[str] | None = None) -> None:
        self.script = script
        self.health = health or ["ok"]  # the health status per check, the last repeated
        self.health_checks = 0
        self.requests: list[str] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> ScriptedGateway:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        path = head.split(" ", 2)[1]
        length = next(
            (int(line.split(":")[1]) for line in head.splitlines() if line.lower().startswith("content-length")), 0
        )
        if length:
            await reader.readexactly(length)
        if path.startswith("/api/health"):
            status = self.health[min(self.health_checks, len(self.health) - 1)]
            self.health_checks += 1
            self.answer(writer, 200, json.dumps({"status": status}).encode())
        else:
            self.requests.append(path)
            step = self.script[min(len(self.requests) - 1, len(self.script) - 1)]
            if isinstance(step, tuple) and step[0] == "stream":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                for line in step[1]:
                    data = json.dumps(line).encode() + b"\n"
                    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
            elif step is not None:
                self.answer(writer, step[0], json.dumps(step[1]).encode())
        await writer.drain()
        writer.close()

    @staticmethod
    def answer(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )


SESSION = {"id": "s1", "kernel": {"id": "k1"}}
REPLY = {"status": "ok", "outputs": [], "execution_count": 1, "duration": 0.1, "text": "ok\n"}
DETACHED = {
    "status": "detached",
    "ended_by": "gateway_restart",
    "outputs": [{"output_type": "stream", "name": "stdout", "text": "half\n"}],
    "execution_count": 3,
    "duration": 2.0,
}
NOT_RUN = (503, {"error": "gateway_restarting", "message": "the gateway is restarting; send it again"})


def scripted_session(sk: AsyncSandkernel) -> Any:
    from sandkernel.agent.client import AsyncSession

    return AsyncSession(sk, dict(SESSION))


async def test_retry_budget_drops_and_503s_for_idempotent_calls_only():
    async with ScriptedGateway([None]) as gw:
        async with AsyncSandkernel(gw.url, ALICE, backoff=0.05, max_retries=4) as sk:
            with pytest.raises(GatewayUnreachableError):
                await sk.list_sessions()
            assert len(gw.requests) == 5  # 1 + max_retries
        gw.requests.clear()
        async with AsyncSandkernel(gw.url, ALICE, backoff=0.05, max_backoff=0.1, restart_wait=1.0) as sk:
            began = time.monotonic()
            with pytest.raises(GatewayUnreachableError):
                await sk.list_sessions()
            # Bounded by time, not by count: it kept retrying until restart_wait was (nearly) up,
            # where the 5 tries above take about 0.45 s, then stopped.
            assert sk.restart_wait - sk.max_backoff < time.monotonic() - began < gave_up_by(sk)
            assert len(gw.requests) > 1
            gw.requests.clear()
            with pytest.raises(GatewayUnreachableError, match="whether it took effect is unknown"):
                await sk.create_session()  # sent, then dropped: never sent again
            assert gw.requests == ["/api/sessions"]
    async with (
        ScriptedGateway([(502, {}), (504, {}), (503, {}), (200, [])]) as gw,
        AsyncSandkernel(gw.url, ALICE) as sk,
    ):
        assert await sk.list_sessions() == [] and len(gw.requests) == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_an_execute_is_sent_again_only_when_the_gateway_says_it_was_not_run(stream):
    on_output = (lambda output: None) if stream else None
    final = ("stream", [{"type": "result", "result": REPLY}]) if stream else (200, REPLY)
    async with ScriptedGateway([NOT_RUN, NOT_RUN, final]) as gw, AsyncSandkernel(gw.url, ALICE, backoff=0.05) as sk:
        result = await scripted_session(sk).run("x = 1", on_output=on_output)
        assert result.ok and result.text == "ok\n" and len(gw.requests) == 3
    busy = (503, {"error": "busy", "message": "later"})
    async with ScriptedGateway([busy, final]) as gw, AsyncSandkernel(gw.url, ALICE, backoff=0.05) as sk:
        with pytest.raises(GatewayError, match="later"):
            await scripted_session(sk).run("x = 1", on_output=on_output)
        assert len(gw.requests) == 1  # any other 503: not sent again


@pytest.mark.parametrize("stream", [False, True])
async def test_a_detached_result_is_gateway_restarted(stream):
    """(c) A result the stopping gateway cut (status detached) raises GatewayRestarted with what
    was produced before the cut; ``raise_for_status`` says the same for a stored Execution."""
    from sandkernel.agent.execution import Execution

    reply = ("stream", [{"type": "result", "result": DETACHED}]) if stream else (200, DETACHED)
    async with ScriptedGateway([reply]) as gw, AsyncSandkernel(gw.url, ALICE, backoff=0.05) as sk:
        with pytest.raises(GatewayRestarted) as err:
            await scripted_session(sk).run("work()", on_output=(lambda o: None) if stream else None)
    restarted = err.value
    assert restarted.came_back and restarted.code == "gateway_restart" and len(gw.requests) == 1
    assert restarted.execution is not None and restarted.execution.status == "detached"
    assert restarted.execution.ended_by == "gateway_restart" and restarted.execution.stdout == "half\n"
    assert "may or may not have run to completion" in str(restarted) and "let go of this execution" in str(restarted)
    assert gw.health_checks == 1
    with pytest.raises(GatewayRestarted):
        Execution.from_reply(DETACHED).raise_for_status()


async def test_a_stopping_gateway_is_not_taken_for_the_one_that_comes_back():
    """After a detached result the old process may still answer its health check, as
    ``stopping``: the client waits for ``ok`` (the next process) before it raises."""
    async with ScriptedGateway([(200, DETACHED)], health=["stopping", "stopping", "ok"]) as gw:
        async with AsyncSandkernel(gw.url, ALICE, backoff=0.05) as sk:
            with pytest.raises(GatewayRestarted) as err:
                await scripted_session(sk).run("work()")
            assert err.value.came_back and gw.health_checks == 3
        gw.health = ["stopping"]
        async with AsyncSandkernel(gw.url, ALICE, backoff=0.05, restart_wait=0.5) as sk:
            assert not await sk.wait_until_up()


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_dropped_execute_is_gateway_restarted_and_never_sent_again(stream, flavour):
    """The connection drops before the result (after one streamed output, or with nothing): the
    execute is not sent again and GatewayRestarted carries what was seen; the sync client (the
    async one on its own loop thread) raises the same."""
    from sandkernel.agent.client import AsyncSession
    from sandkernel.agent.sync_client import Session

    output = {"output_type": "stream", "name": "stdout", "text": "step 1\n"}
    step = ("stream", [{"type": "output", "output": output}]) if stream else None
    seen: list[dict[str, Any]] = []
    on_output = seen.append if stream else None
    async with ScriptedGateway([step]) as gw:
        if flavour == "async":
            async with AsyncSandkernel(gw.url, ALICE, backoff=0.05) as sk:
                with pytest.raises(GatewayRestarted) as err:
                    await scripted_session(sk).run("work()", on_output=on_output)
        else:
            with Sandkernel(gw.url, ALICE, backoff=0.05) as blocking:
                session = Session(blocking, AsyncSession(blocking._async, dict(SESSION)))
                with pytest.raises(GatewayRestarted) as err:
                    await asyncio.to_thread(session.run, "work()", on_output=on_output)
        assert len(gw.requests) == 1  # the execute went once
    restarted = err.value
    assert restarted.came_back and "the connection to the gateway dropped" in str(restarted)
    if stream:
        assert seen == [output] and restarted.execution.stdout == "step 1\n"
        assert restarted.execution.ended_by == "connection_lost"
    else:
        assert restarted.execution is None


async def test_an_execute_to_a_gateway_that_stays_down_was_never_sent():
    """Refused until restart_wait passed: a plain GatewayUnreachableError with ``sent`` False (the
    code never reached a gateway), not GatewayRestarted."""
    with refusing_port() as port:
        async with AsyncSandkernel(f"http://127.0.0.1:{port}", ALICE, backoff=0.05, restart_wait=1.0) as sk:
            began = time.monotonic()
            with pytest.raises(GatewayUnreachableError) as err:
                await scripted_session(sk).run("work()")
            assert err.value.sent is False and not isinstance(err.value, GatewayRestarted)
            assert 0.5 < time.monotonic() - began < gave_up_by(sk)


# -- kill -9 and SIGTERM of a real gateway -------------------------------------------------------


async def running(session, marker: str, timeout: float = 60) -> None:
    """Wait until the code in flight has written its start line (so the kill lands mid-execute)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = {f["name"] for f in await session.list_files()}
        if marker in files:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{marker} never appeared")


LONG_CELL = (
    "import time, pathlib\n"
    "pathlib.Path('runs.txt').open('a').write('start\\n')\n"
    "pathlib.Path('started').touch()\n"
    "time.sleep({seconds})\n"
    "pathlib.Path('runs.txt').open('a').write('done\\n')\n"
    "print('finished')"
)
# Runs until the test uploads 'release' (or 300 s pass): whatever the machine's load, it is still
# running when the test says so, and ends when the test lets it.
GATED_CELL = (
    "import time, pathlib\n"
    "pathlib.Path('runs.txt').open('a').write('start\\n')\n"
    "pathlib.Path('started').touch()\n"
    "deadline = time.monotonic() + 300\n"
    "while not pathlib.Path('release').exists() and time.monotonic() < deadline:\n"
    "    time.sleep(0.1)\n"
    "pathlib.Path('runs.txt').open('a').write('done\\n')\n"
    "print('finished')"
)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_kill9_during_an_execute_raises_gateway_restarted_promptly(gateway, stream):
    """(b) SIGKILL of the gateway under a cell that runs until released, restarted at once:
    GatewayRestarted as soon as the new gateway answers, while the cell still runs (it does not
    wait for the cell's end); never a hang."""
    await gateway.start()
    async with AsyncSandkernel(gateway.url, ALICE, restart_wait=90) as sk:
        session = await sk.create_session(profile="small")
        gateway.session_ids.append(session.id)
        execute = asyncio.create_task(
            session.run(GATED_CELL, timeout=600, on_output=(lambda o: None) if stream else None)
        )
        await running(session, "started")
        gateway.kill9()
        killed = time.monotonic()
        await asyncio.sleep(0.5)
        assert not execute.done()  # it waits for the gateway to come back, it does not give up
        gateway.spawn()
        with pytest.raises(GatewayRestarted) as err:
            await asyncio.wait_for(execute, 120)
        raised = time.monotonic()
        assert err.value.came_back and "may or may not have run to completion" in str(err.value)
        assert (await session.download("runs.txt")).decode().splitlines() == ["start"]  # raised before the cell ended
        print(f"GatewayRestarted {raised - killed:.1f} s after the kill, the cell still running")
        health = await sk.health()  # the next call works without the user doing anything
        assert health["status"] == "ok"


async def test_kill9_during_an_execute_never_runs_it_twice(gateway):
    """(b, with re-adoption) The cut execute is not sent again: the code's start line is written
    once, it finishes in the kernel on its own, and the session keeps its state and ids."""
    await gateway.start()
    async with AsyncSandkernel(gateway.url, ALICE, restart_wait=90) as sk:
        session = await sk.create_session(profile="small")
        gateway.session_ids.append(session.id)
        assert (await session.run("before = 41")).ok
        execute = asyncio.create_task(session.run(LONG_CELL.format(seconds=6), timeout=60))
        await running(session, "started")
        gateway.kill9()
        gateway.spawn()
        with pytest.raises(GatewayRestarted):
            await asyncio.wait_for(execute, 120)
        again = await sk.get_session(session.id)
        assert again.kernel_id == session.kernel_id
        deadline = time.monotonic() + 60
        while b"done" not in await session.download("runs.txt") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert (await session.download("runs.txt")).decode().splitlines() == ["start", "done"]
        assert (await session.run("before + 1")).text == "42\n"


async def test_sigterm_during_an_execute_returns_detached_as_gateway_restarted(gateway):
    """SIGTERM with a 1 s shutdown grace under a cell that runs until released: the gateway cuts
    it (status detached, ended_by gateway_restart) and the client raises GatewayRestarted once a
    new gateway answers; the cell runs on, once, and the next execute queues behind it."""
    await gateway.start()
    async with AsyncSandkernel(gateway.url, ALICE, restart_wait=90) as sk:
        session = await sk.create_session(profile="small")
        gateway.session_ids.append(session.id)
        execute = asyncio.create_task(session.run(GATED_CELL, timeout=600))
        await running(session, "started")
        gateway.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(gateway.proc.wait, 60)
        gateway.spawn()
        with pytest.raises(GatewayRestarted) as err:
            await asyncio.wait_for(execute, 120)
        assert err.value.execution is not None and err.value.execution.status == "detached"
        assert err.value.execution.ended_by == "gateway_restart"
        assert (await session.download("runs.txt")).decode().splitlines() == ["start"]  # once, still running
        await session.upload("release", "")
        assert (await session.run("1 + 1")).text == "2\n"  # after the cut cell ended
        assert (await session.download("runs.txt")).decode().splitlines() == ["start", "done"]


# -- the agent loop -----------------------------------------------------------------------------

STEP_ONE = (
    "import time, pathlib\npathlib.Path('steps.txt').open('a').write('one\\n')\ntime.sleep(30)\nprint('one done')"
)


def restart_turns() -> list[ScriptedTurn]:
    return [
        ScriptedTurn([say("Step one."), call("run_python", code=STEP_ONE)]),
        ScriptedTurn(
            [say("The gateway restarted; checking what step one left."), call("read_file", path="steps.txt")],
            expect=[result_contains("gateway restarted during this step"), result_contains("may not have finished")],
        ),
        ScriptedTurn([call("final_answer", answer="step one ran once")], expect=[result_contains("one")]),
    ]


async def test_agent_loop_tells_the_model_and_carries_on_after_a_restart(gateway):
    """(d) kill -9 and restart of the gateway while the model's first step runs: the tool result
    the model receives says the gateway restarted and the step may not have finished; the loop
    goes on to the next step in the same session and ends with the answer."""
    await gateway.start()
    async with AsyncSandkernel(gateway.url, ALICE, restart_wait=90) as sk:
        session = await sk.create_session(profile="small")
        gateway.session_ids.append(session.id)
        events: list[tuple[str, dict[str, Any]]] = []

        async def restart_when_running() -> None:
            await running(session, "steps.txt", timeout=120)
            gateway.kill9()
            gateway.spawn()

        async with ScriptedMessagesServer(restart_turns()) as server:
            model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
            agent = ClaudeAgent(
                model, session, AgentConfig(stream=True), lambda kind, data: events.append((kind, data))
            )
            restarter = asyncio.create_task(restart_when_running())
            run = await asyncio.wait_for(agent.run("do step one"), 300)
            await restarter
            await model.close()
        assert await session.download("steps.txt") == b"one\n"  # step one ran once; nothing re-sent it
    assert run.stop == "answer" and run.answer == "step one ran once" and run.gateway_restarts == 1
    assert [c.status for c in run.tool_calls] == [GATEWAY_RESTARTED, "ok"]
    first_result = server.requests[1]["messages"][-1]["content"][0]
    assert first_result["is_error"] is True and RESTART_NOTE in first_result["content"]
    assert ("gateway_restart", {"id": run.tool_calls[0].id, "name": "run_python"}) in events


# -- JupyterLab: jupyter_server --gateway-url --------------------------------------------------


def kernel_message(msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
    import uuid

    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "t", "session": "lab", "version": "5.3"}
    return {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": "shell"}


async def reply_to(ws: Any, message: dict[str, Any], kinds: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """The first message of one of ``kinds`` whose parent is ``message`` (others are skipped)."""

    async def wait() -> dict[str, Any]:
        while True:
            raw = await ws.read_message()
            assert raw is not None, "jupyter_server closed the browser's websocket"
            data = json.loads(raw)
            mine = data.get("parent_header", {}).get("msg_id") == message["header"]["msg_id"]
            if mine and data["header"]["msg_type"] in kinds:
                return data

    return await asyncio.wait_for(wait(), timeout)


async def test_jupyter_server_websocket_carries_on_after_a_gateway_restart(gateway):
    """JupyterLab's path: one browser websocket to ``jupyter server --gateway-url``, kept open
    across a kill -9 and restart of the gateway. jupyter_server's GatewayClient reconnects its
    own websocket to the gateway (gateway_retry_max / gateway_retry_interval); once it has, the
    same browser websocket runs code in the same kernel, its variables intact."""
    from tornado.websocket import websocket_connect

    await gateway.start()
    root = gateway.tmp_path / "lab"
    root.mkdir()
    async with jupyter_server(gateway.url, root) as lab:
        status, created = await lab.call("POST", "/api/kernels", {"name": kernel_name_for(gateway.runtime)})
        assert status == 201, (status, created, lab.log_tail())
        kernel_id = created["id"]
        ws = await websocket_connect(lab.websocket_request(kernel_id, "lab"))
        first = kernel_message("execute_request", {"code": "x = 41", "silent": False, "store_history": True,
                                                   "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})  # fmt: skip
        await ws.write_message(json.dumps(first))
        assert (await reply_to(ws, first, ("execute_reply",), 120))["content"]["status"] == "ok"

        gateway.kill9()
        killed = time.monotonic()
        gateway.spawn()
        await gateway.wait_up()
        # Until jupyter_server has reconnected, what the browser sends is dropped (jupyter_server's
        # behaviour): ask for kernel_info (harmless to repeat) until it is answered.
        reconnected = None
        while reconnected is None and time.monotonic() - killed < 90:
            probe = kernel_message("kernel_info_request", {})
            await ws.write_message(json.dumps(probe))
            with contextlib.suppress(asyncio.TimeoutError):
                reconnected = await reply_to(ws, probe, ("kernel_info_reply",), 2)
        assert reconnected is not None, "jupyter_server did not reconnect to the restarted gateway in 90 s"
        print(f"jupyter_server answered again {time.monotonic() - killed:.1f} s after the kill")
        again = kernel_message("execute_request", {"code": "x + 1", "silent": False, "store_history": True,
                                                   "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})  # fmt: skip
        await ws.write_message(json.dumps(again))
        result = await reply_to(ws, again, ("execute_result", "error"), 60)
        assert result["content"]["data"]["text/plain"] == "42"
        ws.close()
        async with AsyncSandkernel(gateway.url, ALICE) as sk:
            assert kernel_id in [k["id"] for k in await sk.request("GET", "/api/kernels")]
            await sk.request("DELETE", f"/api/kernels/{kernel_id}")


# -- the agent loop against scripted faults (no containers) -------------------------------------

MARKDOWN_OK = (200, {})


async def test_agent_loop_goes_on_after_a_dropped_step_and_stops_on_a_lost_sandbox():
    """The loop's side alone: a step whose connection drops gives the model the restart note (and
    is not counted as a failure to re-plan over), the next step runs; a sandbox the gateway came
    back without (410) ends the run as ``sandbox_lost``, not with a traceback."""
    # task note, prose, execute (dropped), transcript note, prose, execute, answer note
    read_back = (200, {**REPLY, "text": "one\n"})
    script = [MARKDOWN_OK, MARKDOWN_OK, None, MARKDOWN_OK, MARKDOWN_OK, read_back, MARKDOWN_OK]
    async with (
        ScriptedGateway(script) as gw,
        AsyncSandkernel(gw.url, ALICE, backoff=0.05) as sk,
        ScriptedMessagesServer(restart_turns()) as server,
    ):
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        run = await ClaudeAgent(model, scripted_session(sk), AgentConfig(stream=False)).run("do step one")
        await model.close()
    assert run.stop == "answer" and run.gateway_restarts == 1 and run.replans == 0
    assert [c.status for c in run.tool_calls] == [GATEWAY_RESTARTED, "ok"]
    calls = [path.rsplit("/", 1)[1] for path in gw.requests]  # one execute per step, none sent again
    assert calls == ["markdown", "markdown", "execute", "markdown", "markdown", "execute", "markdown"]
    lost = (410, {"error": "sandbox_lost", "message": "its container was OOM-killed while no gateway was attached"})
    async with (
        ScriptedGateway([MARKDOWN_OK, MARKDOWN_OK, lost]) as gw,
        AsyncSandkernel(gw.url, ALICE) as sk,
        ScriptedMessagesServer(restart_turns()) as server,
    ):
        model = anthropic.AsyncAnthropic(base_url=server.url, api_key="offline-test", max_retries=0)
        run = await ClaudeAgent(model, scripted_session(sk), AgentConfig(stream=False)).run("do step one")
        await model.close()
    assert run.stop == "sandbox_lost" and "OOM-killed" in run.answer and len(server.requests) == 1
