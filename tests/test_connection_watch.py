"""The check before each execute of a savable sandbox (issue 33): its kernel is probed through
the supervisor's relay only when its shell connection changed since the last probe found it
alive (kernels/execution/connection_watch.py). Skipping the probe must never hide a death.

The pure test drives the watch over a real ZMQ connection; the gVisor one counts the probes that
cross the relay (the container's own probe, wrapped) while a real savable session runs cells,
restarts, and loses its kernel between two executes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import zmq

from sandkernel.kernels.execution.connection_watch import ShellConnectionWatch
from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.container import SandboxContainer

from .conftest import RUNSC, require_runtime

EVENT_DEADLINE = 10.0  # seconds libzmq's I/O thread may take to report a connection's end


def until_unsteady(watch: ShellConnectionWatch) -> bool:
    deadline = time.monotonic() + EVENT_DEADLINE
    while watch.steady():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_connection_that_ends_or_comes_back_unsteadies_the_watch(tmp_path: Path):
    context = zmq.Context()  # a plain one: the watch takes any socket, the product gives it its asyncio one
    address = f"ipc://{tmp_path}/shell"
    peer = context.socket(zmq.ROUTER)
    peer.bind(address)
    client = context.socket(zmq.DEALER)
    client.connect(address)
    watch = ShellConnectionWatch(client)
    try:
        assert not watch.steady()  # never confirmed: the first check probes
        # A message through, so the connection's own events (connected, handshake) came first,
        # as a session's start has its kernel answer before its first execute.
        client.send(b"ping")
        assert peer.poll(EVENT_DEADLINE * 1000)
        watch.steady()
        watch.confirm()
        assert watch.steady() and watch.steady()  # nothing happened: no probe needed
        peer.close(linger=0)  # the kernel's end goes (the relay closes the host's connection)
        assert until_unsteady(watch)
        watch.confirm()  # a probe found a kernel alive again...
        peer = context.socket(zmq.ROUTER)
        peer.bind(address)  # ...and the connection coming back is an event too
        assert until_unsteady(watch)
    finally:
        watch.close()
        client.close(linger=0)
        peer.close(linger=0)
        context.term()


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_a_savable_kernel_is_probed_only_after_its_connection_changed(runtime, monkeypatch):
    require_runtime(runtime)
    probes = 0
    probe = SandboxContainer._supervised_kernel_exit_code

    async def counted(self: SandboxContainer) -> int | None:
        nonlocal probes
        probes += 1
        return await probe(self)

    monkeypatch.setattr(SandboxContainer, "_supervised_kernel_exit_code", counted)
    async with await KernelSession.start(overrides={"runtime": runtime}, savable=True) as session:
        assert (await session.execute("x = 1", timeout=60)).status is ExecutionStatus.OK
        first = probes
        for _ in range(5):
            assert (await session.execute("x += 1", timeout=60)).status is ExecutionStatus.OK
        assert probes == first, f"a steady connection's kernel was probed again ({first} probes, then {probes})"

        await session.restart()  # the supervisor detaches, starts a kernel, attaches: events
        before = probes
        after_restart = await session.execute("print('fresh' if 'x' not in dir() else x)", timeout=60)
        assert after_restart.text == "fresh\n" and probes > before

        # The kernel dies while no cell runs: the next execute finds out first, restarts it and
        # runs the cell there (never sent to the dead one, never reported lost).
        killer = "import os, threading; threading.Timer(0.5, os.kill, (os.getpid(), 9)).start()"
        assert (await session.execute(killer, timeout=60)).status is ExecutionStatus.OK
        # Until its end reaches the host's shell connection (libzmq reports it within ms of the
        # relay's close; an execute sent in those ms meets the death as one during its cell).
        watch = session._kernel._shell_watch
        assert watch is not None and watch.steady()
        deadline = time.monotonic() + 30
        while watch.steady():
            assert time.monotonic() < deadline, "the kernel's death never reached its connection"
            await asyncio.sleep(0.01)
        while await session.container.kernel_exit_code() is None:  # dead, not only disconnected
            assert time.monotonic() < deadline, "the kernel was disconnected, but did not die"
            await asyncio.sleep(0.01)
        after_death = await session.execute("print('back')", timeout=60)
        assert after_death.status is ExecutionStatus.OK and after_death.text == "back\n"
        assert "died between executions" in (after_death.state_lost or ""), after_death.state_lost
