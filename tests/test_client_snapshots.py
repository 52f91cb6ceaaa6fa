"""The client's pause, resume, fork and rewind against a real gateway, and the snapshot refusals
raised as their own exceptions. runc only and few cells, to stay quick: the gateway's own tests
cover both runtimes at the API level (a replay resume runs the same cells either way)."""

from __future__ import annotations

import asyncio

import pytest

from sandkernel import errors as gateway_errors
from sandkernel.agent import (
    AsyncSandkernel,
    AsyncSession,
    ConflictError,
    LimitExceededError,
    Sandkernel,
    Session,
    SessionBusyError,
    SessionPausedError,
    SnapshotFailedError,
    SnapshotQuotaError,
    SnapshotRejectedError,
)
from sandkernel.agent.errors import CODE_ERRORS, error_for_status
from sandkernel.python_syntax import literal_eval

from .gateway_fixtures import ALICE, gateway_fixture

gateway = gateway_fixture(max_sessions=6)


@pytest.fixture(scope="module")
async def client(gateway):
    async with AsyncSandkernel(gateway.url, ALICE) as sk:
        yield sk


def test_each_snapshot_refusal_is_its_own_exception():
    """Callers catch what they can act on: a full quota is a limit, a busy session waits, and
    every one is still a 409 ConflictError for callers that catch broadly."""
    expected = {
        gateway_errors.SnapshotError.code: SnapshotFailedError,
        gateway_errors.SnapshotRejectedError.code: SnapshotRejectedError,
        gateway_errors.SnapshotQuotaError.code: SnapshotQuotaError,
        gateway_errors.SessionPausedError.code: SessionPausedError,
        gateway_errors.SessionBusyError.code: SessionBusyError,
    }
    assert expected == CODE_ERRORS  # the client's strings are the gateway's codes
    for code, cls in expected.items():
        error = error_for_status(409, "why", code)
        assert type(error) is cls and isinstance(error, ConflictError) and error.code == code
    assert isinstance(error_for_status(409, "full", "snapshot_quota_exceeded"), LimitExceededError)
    assert isinstance(error_for_status(409, "bad", "snapshot_rejected"), SnapshotFailedError)
    assert type(error_for_status(409, "other", "something_else")) is ConflictError


async def _names(session: AsyncSession, *names: str) -> list[str]:
    """Which of ``names`` the kernel defines now."""
    probe = await session.run(f"sorted(n for n in {list(names)!r} if n in globals())", check=True)
    return literal_eval(probe.text)


@pytest.mark.docker
async def test_pause_then_execute_resumes_with_variables_and_files(client):
    async with client.session(profile="small") as s:
        await s.run("total = 41", check=True)
        await s.upload("note.txt", "kept")
        paused = await s.pause()
        assert paused["state"] == "paused" and s.state == "paused"
        assert paused["snapshot"]["cells"] >= 1 and paused["snapshot"]["bytes"] > 0
        assert (await client.get_session(s.id)).state == "paused"  # GET says so
        with pytest.raises(SessionPausedError):  # an interrupt needs the kernel: not resumed by it
            await s.interrupt()

        resumed = await s.resume()  # explicit: the verdicts are shown
        assert resumed["state"] == "running" and resumed["restored_by"] == "replay"
        assert [c["verdict"] for c in resumed["cells"]] == ["same"], resumed["cells"]
        assert (await s.run("total + 1", check=True)).text.strip() == "42"
        assert (await s.resume())["restored_by"] is None  # running already: nothing to do

        await s.pause()
        again = await s.run("total + 1", check=True)  # the execute resumes it by itself
        assert again.text.strip() == "42"
        assert (await s.refresh())["state"] == "running"
        assert await s.download("note.txt") == b"kept"


@pytest.mark.docker
async def test_fork_copies_the_state_and_the_forks_diverge(client):
    async with client.session(profile="small") as parent:
        await parent.run("trail = ['parent']", check=True)
        forks = await parent.fork(2)
        try:
            assert len(forks) == 2 and len({parent.id, *(f.id for f in forks)}) == 3
            for number, fork in enumerate(forks):
                assert isinstance(fork, AsyncSession) and fork.client is client
                assert fork.restore is not None and fork.restore["restored_by"] == "replay", fork.restore
                await fork.run(f"trail.append('fork{number}')", check=True)
            for number, fork in enumerate(forks):
                assert literal_eval((await fork.run("trail", check=True)).text) == ["parent", f"fork{number}"]
            assert literal_eval((await parent.run("trail", check=True)).text) == ["parent"]
        finally:
            for fork in forks:
                await fork.delete()


@pytest.mark.docker
async def test_rewind_forgets_what_later_cells_made(client):
    async with client.session(profile="small") as s:
        for code in ("a = 1", "b = 2", "c = 3\nopen('c.txt', 'w').write('three')"):
            await s.run(code, check=True)
        assert await _names(s, "a", "b", "c") == ["a", "b", "c"]
        reply = await s.rewind(1)  # cells count from 1: the state right after `a = 1`
        assert reply["rewound_to"] == 1 and reply["state"] == "running", reply
        assert await _names(s, "a", "b", "c") == ["a"]
        assert "c.txt" not in {entry["name"] for entry in await s.list_files()}


# A cell that runs until the test uploads the file ``go`` (files can be written while code runs).
WAIT_FOR_GO = (
    "import os, time\nprint('started', flush=True)\nwhile not os.path.exists('go'):\n    time.sleep(0.05)\n'done'"
)


@pytest.mark.docker
async def test_a_pause_while_code_runs_is_refused_as_busy(client):
    async with client.session(profile="small") as s:
        started = asyncio.Event()
        running = asyncio.create_task(s.run(WAIT_FOR_GO, on_stdout=lambda text: started.set()))
        await asyncio.wait_for(started.wait(), 60)  # the cell runs: no timing guess
        with pytest.raises(SessionBusyError):
            await s.pause()
        await s.upload("go", "")  # the cell ends only now, so the pause surely met it running
        assert (await running).text.strip().endswith("'done'")
        assert (await s.refresh())["state"] == "running"


@pytest.mark.docker
async def test_the_sync_client_forks_into_sync_sessions(gateway):
    def use_it() -> tuple[str, str | None, str]:
        with Sandkernel(gateway.url, ALICE) as sk, sk.session(profile="small") as s:
            s.run("x = 7", check=True)
            (fork,) = s.fork()
            try:
                assert isinstance(fork, Session)
                return fork.run("x * 6", check=True).text.strip(), (fork.restore or {}).get("restored_by"), s.state
            finally:
                fork.delete()

    value, restored_by, parent_state = await asyncio.to_thread(use_it)
    assert (value, restored_by, parent_state) == ("42", "replay", "running")
