"""An exec's stream is read within a deadline, and a sandbox's helpers are bounded per lane
(kernels/sandbox/exec_stream.py, container.HelperSlots): the pure parts, on real sockets. The
whole path, against a sandbox that stops its helpers, is tests/security/test_tenant_limits.py."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest

from sandkernel.errors import HelpersBusyError
from sandkernel.kernels.sandbox.container import HelperSlots
from sandkernel.kernels.sandbox.exec_stream import Deadline, ExecStreamError, frames


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


def test_frames_are_read_until_eof():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frame(1, b"out") + frame(2, b"err") + frame(1, b"more"))
        theirs.shutdown(socket.SHUT_WR)
        assert list(frames(ours, Deadline(5), "a helper")) == [(1, b"out"), (2, b"err"), (1, b"more")]


def test_a_stalled_stream_ends_at_its_deadline():
    """A helper the sandbox stopped sends half a frame and then nothing: the read ends at the
    deadline (docker-py's own read waited for ever), naming the helper and its limit."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frame(1, b"partial")[:5])
        with pytest.raises(ExecStreamError, match=r"the list helper did not finish within its 0\.3 s limit"):
            list(frames(ours, Deadline(0.3), "the list helper"))


def test_a_cancelled_caller_stops_the_read():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        deadline = Deadline(None)
        threading.Timer(0.2, deadline.stop.set).start()
        theirs.sendall(frame(1, b"x"))
        with pytest.raises(ExecStreamError, match="was cancelled"):
            for _ in frames(ours, deadline, "packing"):
                theirs.sendall(frame(1, b"x"))  # a stream that never ends: only the stop ends it


async def test_helpers_beyond_a_lanes_queue_are_refused_at_once():
    slots = HelperSlots(running=2, waiting=1)
    release = asyncio.Event()
    admitted: list[int] = []

    async def helper(n: int) -> None:
        async with slots.held("the list helper"):
            admitted.append(n)
            await release.wait()

    held = [asyncio.ensure_future(helper(n)) for n in range(3)]
    while len(admitted) < 2:
        await asyncio.sleep(0)
    with pytest.raises(HelpersBusyError, match="already has 3 such calls running or waiting"):
        await helper(3)
    assert admitted == [0, 1]  # the third waits for a slot; the fourth was refused, not queued
    release.set()
    await asyncio.gather(*held)
    assert admitted == [0, 1, 2]
    await helper(4)  # room again once they finished
    assert admitted[-1] == 4
