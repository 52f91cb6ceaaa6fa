"""Density: an idle session costs its gateway nothing per second (issue 17: 200 idle sessions).

Between executes the drain (kernels/execution/drain.py) is the only thing of a session that
waits on its kernel. It used to poll with a one-second timeout, so N idle sessions cost N
wake-ups a second of the gateway's event loop; now it waits until a message, a reader or the
channels' close. These tests prove both halves: no polling while idle, and the drain still
discards (and counts) output that arrives while idle, at once.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq.asyncio

from sandkernel.kernels.execution.events import SessionObserver
from sandkernel.kernels.execution.session import KernelSession
from tests.conftest import RUNTIME_PARAMS, require_runtime

pytestmark = pytest.mark.docker

# A timer thread prints after the cell returned: output no execution reads.
LATE_PRINT = "import threading\nthreading.Timer(0.2, print, ['late']).start()"


class Notes(SessionObserver):
    def __init__(self) -> None:
        self.notes: list[str] = []

    async def note_added(self, text: str) -> None:
        self.notes.append(text)


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_an_idle_session_does_not_poll_and_still_drains_late_output(runtime, monkeypatch):
    require_runtime(runtime)
    polls = 0
    poll = zmq.asyncio.Poller.poll

    def counted(self, timeout=-1):  # type: ignore[no-untyped-def]
        nonlocal polls
        polls += 1
        return poll(self, timeout)

    monkeypatch.setattr(zmq.asyncio.Poller, "poll", counted)
    notes = Notes()
    session = await KernelSession.start(overrides={"runtime": runtime})
    try:
        session.add_observer(notes)
        assert (await session.execute("1+1", timeout=60)).outputs[-1]["data"]["text/plain"] == "2"
        await asyncio.sleep(0.5)  # the drain takes the channels back after the execute
        before = polls
        await asyncio.sleep(3.5)
        assert polls == before, f"an idle session's drain polled {polls - before} times in 3.5 s"

        await session.execute(LATE_PRINT, timeout=60)
        await asyncio.sleep(4)  # 'late' arrives while no execution runs (a margin for a loaded host)
        # Noted only if the drain discarded it when it came: an execute skips others' output.
        result = await session.execute("1+1", timeout=60)
        assert result.outputs[-1]["data"]["text/plain"] == "2"
        assert not any(o.get("text") == "late\n" for o in result.outputs), result.outputs
        assert any("output after the cell returned: 1 messages" in note for note in notes.notes), notes.notes
    finally:
        await session.shutdown()


def gateway_threads() -> int:
    """Threads of this process, native ones included (libzmq's I/O and reaper threads)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_an_idle_session_adds_no_thread_to_the_gateway(runtime):
    """Each session used to bring three threads (its zmq context's I/O and reaper threads, and
    jupyter_client's heartbeat thread, which woke every second and nothing read): 609 threads
    and ~5% of a core for 200 idle sessions. A session's threads must not scale with N."""
    require_runtime(runtime)
    sessions = [await KernelSession.start(overrides={"runtime": runtime})]
    try:
        before = gateway_threads()
        for _ in range(2):
            sessions.append(await KernelSession.start(overrides={"runtime": runtime}))
        for session in sessions:
            assert (await session.execute("1+1", timeout=60)).outputs[-1]["data"]["text/plain"] == "2"
        assert gateway_threads() <= before, f"{gateway_threads() - before} threads more for 2 more idle sessions"
    finally:
        for session in sessions:
            await session.shutdown()
