"""Lifecycle calls that race each other on one session end cleanly (docs/sessions-api.md,
"Calls at the same time").

Every pair of {execute, interrupt, restart, delete, pause, resume, fork, rewind, upload} is sent
to one session within a few milliseconds of each other while a cell is running. Each call, the
running cell's own execute included, must answer one of its documented statuses (never a 5xx);
nothing is logged at ERROR; afterwards the session answers ``6*7`` (resumed if it was paused) or is
cleanly gone (404 with no container left); its notebook is valid; every fork a call made is a
working session of its own and leaves nothing behind once deleted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nbformat
import pytest

from sandkernel import doors
from sandkernel.kernels.execution.events import SessionObserver
from sandkernel.kernels.model.profiles import resolve_profile

from .conftest import RUNC, RUNSC, container_ids_of
from .gateway_fixtures import Gateway, call_api, gateway_fixture

pytestmark = pytest.mark.docker

# The running cell: prints as it goes, long enough for both calls to land while it runs, short
# enough that a pair that ends nothing waits little for it.
RUNNING_CELL = "import time\nfor i in range(40):\n    print(i, flush=True)\n    time.sleep(0.05)\n'done'"
FIRST_CELL = "x = 6"

Call = Callable[[Gateway, str], Awaitable[tuple[int, Any]]]


async def _execute(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": "y = 7\ny"})


async def _interrupt(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/interrupt")


async def _restart(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/restart")


async def _delete(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("DELETE", f"/api/sessions/{sid}")


async def _pause(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/pause")


async def _resume(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/resume")


async def _fork(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/fork", {"count": 1})


async def _rewind(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("POST", f"/api/sessions/{sid}/rewind", {"cell": 1})


async def _upload(gw: Gateway, sid: str) -> tuple[int, Any]:
    return await gw.request("PUT", f"/api/sessions/{sid}/files/race.txt", raw=b"raced\n")


# The calls, and the statuses each may answer while another call races it (the table in
# docs/sessions-api.md): 404 is "the session was deleted first", 409 a documented conflict
# (busy: a snapshot of a running cell; paused: a kernel call on a paused session; a restart under
# way for an interrupt is 200 saying so).
CALLS: dict[str, tuple[Call, set[int]]] = {
    "execute": (_execute, {200, 404}),
    "interrupt": (_interrupt, {200, 204, 404, 409}),
    "restart": (_restart, {200, 404, 409}),
    "delete": (_delete, {204, 404}),
    "pause": (_pause, {200, 404, 409}),
    "resume": (_resume, {200, 404}),
    "fork": (_fork, {201, 404, 409}),
    "rewind": (_rewind, {200, 404, 409}),
    # 409 sandbox_helper_killed: a restart ends every process of the sandbox, a write's helper too.
    "upload": (_upload, {201, 404, 409}),
}
PAIRS = list(itertools.combinations_with_replacement(CALLS, 2))
# Under gVisor the pairs whose outcome the runtime can change: those that end or replace the
# kernel or its container (a restart, a delete, a pause and what brings a session back).
SANDBOX_CALLS = {"restart", "delete", "pause", "rewind", "fork"}
RUNSC_PAIRS = [pair for pair in PAIRS if SANDBOX_CALLS & set(pair) and "upload" not in pair]
# What the running cell's own execute may end as, by the status of its answer.
RUNNING_CELL_ENDS = {"ok", "interrupted", "restarted", "deleted"}

gateway = gateway_fixture(runtimes=[RUNC, RUNSC], max_sessions=6)  # each test names its runtime
# How long the running cell may take to print (its first line comes within a start of the kernel).
PRINT_DEADLINE = resolve_profile(None).execute_timeout


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, from any logger, while the test runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _running_session(gw: Gateway) -> tuple[str, asyncio.Task]:
    """A session with one recorded cell and a second one running (its first output arrived), and
    the task of that cell's streaming execute (its status and NDJSON lines)."""
    code, made = await gw.request("POST", "/api/sessions", {})
    assert code == 201, made
    sid = made["id"]
    code, result = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": FIRST_CELL})
    assert code == 200 and result["status"] == "ok", result
    printed = asyncio.Event()

    def on_chunk(chunk: bytes) -> None:
        if b'"output"' in chunk:
            printed.set()

    chunks: list[bytes] = []

    def collect(chunk: bytes) -> None:
        chunks.append(chunk)
        on_chunk(chunk)

    async def run() -> tuple[int, Any]:
        status, _, _ = await call_api(
            f"{gw.url}/api/sessions/{sid}/execute?stream=1",
            "POST",
            {"code": RUNNING_CELL},
            streaming_callback=collect,
        )
        lines = [json.loads(line) for line in b"".join(chunks).splitlines() if line.strip()]
        return status, lines

    task = asyncio.create_task(run())
    await asyncio.wait_for(printed.wait(), PRINT_DEADLINE)
    return sid, task


def _forks_of(answer: tuple[int, Any]) -> list[str]:
    code, body = answer
    return [fork["session"]["id"] for fork in body["forks"]] if code == 201 else []


@pytest.mark.parametrize("gateway", [RUNC], indirect=True)
@pytest.mark.parametrize("first,second", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
async def test_two_calls_at_once_on_a_running_session_end_cleanly(gateway, first, second):
    await _race(gateway, first, second)


@pytest.mark.parametrize("gateway", [RUNSC], indirect=True)
@pytest.mark.parametrize("first,second", RUNSC_PAIRS, ids=[f"{a}+{b}" for a, b in RUNSC_PAIRS])
async def test_two_calls_that_end_or_replace_the_sandbox_end_cleanly_under_gvisor(gateway, first, second):
    await _race(gateway, first, second)


async def _race(gateway: Gateway, first: str, second: str) -> None:
    """Both calls at once with a cell running; see the module's docstring for what must hold."""
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    sid, running = await _running_session(gateway)
    forks: list[str] = []
    try:
        answers = await asyncio.gather(CALLS[first][0](gateway, sid), CALLS[second][0](gateway, sid))
        for name, (code, body) in zip((first, second), answers, strict=True):
            assert code in CALLS[name][1], f"{name} answered {code}: {body}"
            if code >= 400:
                assert isinstance(body, dict) and body.get("message"), f"{name}: an error without a message: {body}"
            forks += _forks_of((code, body)) if name == "fork" else []
        code, lines = await running
        assert code in (200, 404), lines
        if code == 200:
            ended = lines[-1]
            assert ended["type"] == "result", lines
            assert ended["result"]["status"] in RUNNING_CELL_ENDS, json.dumps(lines)[:3000]
        deleted = "delete" in (first, second) and any(
            name == "delete" and answer[0] == 204 for name, answer in zip((first, second), answers, strict=True)
        )
        await _check_after(gateway, sid, deleted)
        for fork in forks:
            await _check_after(gateway, fork, deleted=False)
        assert not [r.getMessage() for r in errors.records], "errors logged during the race"
    finally:
        logging.getLogger().removeHandler(errors)
        if not running.done():
            running.cancel()
        for left in [sid, *forks]:
            await gateway.request("DELETE", f"/api/sessions/{left}")
            assert container_ids_of(left) == [], f"a container of {left} was left behind"


async def _check_after(gw: Gateway, sid: str, deleted: bool) -> None:
    """The session answers 6*7 (resumed first if it is paused) with a valid notebook, or it is
    gone: 404, and no container."""
    code, result = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": "6*7"})
    if deleted:
        assert code == 404, result
        assert container_ids_of(sid) == []
        return
    assert code == 200 and result["status"] == "ok", result
    assert result["outputs"][-1]["data"]["text/plain"] == "42", result
    code, notebook = await gw.request("GET", f"/api/sessions/{sid}/notebook")
    assert code == 200, notebook
    nbformat.validate(nbformat.from_dict(notebook))
    assert len(container_ids_of(sid)) == 1, "one container per live session"


async def _until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop (nothing else) until ``condition`` holds."""
    while not condition():
        await asyncio.sleep(0)


def _code_cells(notebook: dict[str, Any]) -> list[dict[str, Any]]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


class Restarts(SessionObserver):
    """Counts the kernel's restarts."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    async def kernel_restarted(self, reason: str, container_replaced: bool) -> None:
        self.reasons.append(reason)


@pytest.mark.parametrize("gateway", [RUNC], indirect=True)
async def test_two_restarts_at_once_are_one_and_the_running_cell_says_who_asked(gateway):
    sid, running = await _running_session(gateway)
    try:
        managed = gateway.server.registry.get("alice", sid)
        restarts = Restarts()
        managed.session.add_observer(restarts)
        # In one turn of the event loop: the second certainly finds the first under way.
        await asyncio.gather(managed.restart(doors.SESSION_API), managed.restart(doors.KERNEL_API))
        assert len(restarts.reasons) == 1, restarts.reasons
        code, lines = await running
        result = lines[-1]["result"]
        assert code == 200 and result["status"] == "restarted", result
        assert "through the session_api door" in result["state_lost"], result
        code, answer = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "x"})
        assert answer["status"] == "error" and answer["error"]["name"] == "NameError", answer
        code, notebook = await gateway.request("GET", f"/api/sessions/{sid}/notebook")
        cell = _code_cells(notebook)[1]
        assert cell["metadata"]["sandkernel"]["status"] == "restarted", cell["metadata"]
        # The restart took the memory of the cells up to the restarted one: a pause and resume
        # re-runs only the cell after it (``x``, on the fresh kernel), not ``x = 6``.
        code, paused = await gateway.request("POST", f"/api/sessions/{sid}/pause")
        assert code == 200, paused
        code, resumed = await gateway.request("POST", f"/api/sessions/{sid}/resume")
        assert code == 200, resumed
        assert [c["cell"] for c in resumed["cells"] if c["verdict"] != "not run"] == [3], resumed["cells"]
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


@pytest.mark.parametrize("gateway", [RUNC], indirect=True)
async def test_an_interrupt_during_a_restart_says_it_sent_nothing(gateway):
    sid, running = await _running_session(gateway)
    try:
        managed = gateway.server.registry.get("alice", sid)
        restart = asyncio.create_task(managed.restart(doors.KERNEL_API))
        await asyncio.wait_for(_until(lambda: managed.session.restarting), PRINT_DEADLINE)
        code, answer = await gateway.request("POST", f"/api/sessions/{sid}/interrupt")
        assert code == 200 and answer["interrupted"] is False and "restart" in answer["reason"], answer
        await restart
        _, lines = await running
        assert lines[-1]["result"]["status"] == "restarted", lines[-1]
        assert "through the kernel_api door" in lines[-1]["result"]["state_lost"]
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


@pytest.mark.parametrize("gateway", [RUNC], indirect=True)
async def test_a_delete_ends_the_running_cell_as_deleted_and_the_transcript_says_so(gateway):
    sid, running = await _running_session(gateway)
    path = gateway.server.registry.get("alice", sid).recorder.path
    queued = asyncio.create_task(gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "1"}))
    code, _ = await gateway.request("DELETE", f"/api/sessions/{sid}")
    assert code == 204
    code, lines = await running
    result = lines[-1]["result"]
    assert code == 200 and result["status"] == "deleted" and lines[0]["type"] == "output", lines
    code, refused = await queued
    assert code == 404 and refused["error"] in ("session_closed", "not_found"), refused
    assert container_ids_of(sid) == []
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert [c.metadata["sandkernel"]["status"] for c in _code_cells(notebook)] == ["ok", "deleted"]
