"""An exec's stream is read within a deadline, and a sandbox's helpers are bounded per lane
(kernels/sandbox/exec_stream.py, container.HelperSlots): the pure parts, on real sockets. The
whole path, against a sandbox that stops its helpers, is tests/security/test_tenant_limits.py."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import docker
import pytest

from sandkernel.errors import HelpersBusyError
from sandkernel.kernels.sandbox.container import HelperSlots
from sandkernel.kernels.sandbox.exec_stream import (
    RELEASE_GRACE,
    Deadline,
    ExecStreamError,
    HeldOutput,
    frames,
    start_exec,
)


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


TOKEN = "0123456789abcdef0123456789abcdef"
TRAILER = f"{TOKEN}:000".encode()


def held_output(
    theirs: socket.socket, *chunks: bytes, wait_for_release: bool = False, after_release: bytes = b""
) -> threading.Thread:
    """The sandbox's side: send ``chunks``; then, held, wait for the host's half-close (as the
    shell's ``read`` does), send ``after_release`` and end the stream; else end it at once."""
    released = threading.Event()

    def sandbox() -> None:
        for chunk in chunks:
            theirs.sendall(chunk)
        if wait_for_release:
            theirs.settimeout(5)
            if theirs.recv(1) == b"":
                released.set()
            theirs.sendall(after_release)
        theirs.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=sandbox, daemon=True)
    thread.released = released  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_a_held_helpers_trailer_is_taken_off_and_releases_it():
    """The trailer, split across frames as dockerd may split it, is not part of the output and
    gives the program's status; once read, the host closes its end for writing (the shell's
    stdin), which is what lets it exit; stderr still on its way after the trailer is kept."""
    ours, theirs = socket.socketpair()
    trailer = f"{TOKEN}:003".encode()
    with ours, theirs:
        chunks = (frame(1, b"data" + trailer[:10]), frame(2, b"warn"), frame(1, trailer[10:]))
        sandbox = held_output(theirs, *chunks, wait_for_release=True, after_release=frame(2, b"late stderr"))
        output = HeldOutput(ours, Deadline(5), "a file read", TOKEN)
        received = list(output)
        sandbox.join(5)
    assert sandbox.released.is_set()  # the host's half-close reached the sandbox's side
    assert b"".join(data for stream, data in received if stream == 1) == b"data"
    assert b"".join(data for stream, data in received if stream == 2) == b"warnlate stderr"
    assert output.complete and output.status == 3 and not output.lingering


def test_a_held_helper_that_does_not_go_once_released_is_given_up_with_its_output_whole():
    """A holder whose stream does not end after its release (its stdin's end never reached it):
    the output and status are already whole, so the read ends after the grace, not the deadline."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(frame(1, b"all of it" + TRAILER))  # and never ends the stream
        output = HeldOutput(ours, Deadline(60), "a file read", TOKEN)
        started = time.monotonic()
        assert list(output) == [(1, b"all of it")]
        assert time.monotonic() - started < RELEASE_GRACE + 5  # not the 60 s deadline
    assert output.complete and output.lingering and output.status == 0


def test_a_held_helper_cut_before_its_trailer_is_an_error_not_short_output():
    """dockerd closed the stream before the end (a reader more than 2 s behind): without the
    trailer, an exit code below 128 (the holder was not killed) is not believed."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        held_output(theirs, frame(1, b"half of the file"), frame(1, TRAILER[:20]))
        output = HeldOutput(ours, Deadline(5), "a file read", TOKEN)
        assert b"".join(data for _, data in output) == b"half of the file" + TRAILER[:20]
    assert not output.complete and output.status is None
    with pytest.raises(ExecStreamError, match="a file read: the sandbox's output was cut short before its end"):
        output.judged(0)
    with pytest.raises(ExecStreamError, match="cut short"):
        output.judged(2)  # the shell exits with the program's status after writing the trailer


def test_a_killed_held_helper_keeps_its_output_and_its_code():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        held_output(theirs, frame(1, b"as far as it got"))
        output = HeldOutput(ours, Deadline(5), "a file read", TOKEN)
        assert list(output) == [(1, b"as far as it got")]
    assert output.judged(137) == 137  # the holder was killed: the code says so, no stream error on top


def test_a_trailer_not_at_the_end_is_not_the_end():
    """Output the sandbox wrote after a trailer (a background process, or a forged trailer) means
    the trailer was not the last word: the output is kept whole and not believed complete."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        held_output(theirs, frame(1, b"a" + TRAILER), frame(1, b"late"))
        output = HeldOutput(ours, Deadline(5), "a file read", TOKEN)
        assert b"".join(data for _, data in output) == b"a" + TRAILER + b"late"
    assert not output.complete and output.status is None
    with pytest.raises(ExecStreamError, match="cut short"):
        output.judged(0)


def test_output_that_came_with_the_start_answer_is_not_lost(tmp_path):
    """dockerd writes the exec start's upgrade headers, then the process's output on the same
    connection; a gateway thread that reads the headers late (a loaded host) gets both in one
    read, which http.client's buffered reader keeps. Those bytes are read first, not lost (they
    were: a held helper then waited its whole 60 s deadline). A stand-in engine on a unix
    socket answers the start exactly so, as a busy dockerd's answer arrives; the request goes
    through docker-py's own client."""
    path = str(tmp_path / "docker.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    answer = (
        b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.raw-stream\r\n"
        b"Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n" + frame(1, b"first") + frame(2, b"warn") + frame(1, b"x" * 3000)
    )

    def engine() -> None:
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            while len(body) < length:
                body += conn.recv(4096)
            conn.sendall(answer)  # headers and output in one write: as a late reader finds them
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)

    server = threading.Thread(target=engine, daemon=True)
    server.start()
    api = docker.APIClient(base_url=f"unix://{path}", version="1.41")
    try:
        stream = start_exec(api, "c" * 64, "e" * 64, Deadline(5), "a file read")
        try:
            assert list(frames(stream, Deadline(5), "a file read")) == [(1, b"first"), (2, b"warn"), (1, b"x" * 3000)]
        finally:
            stream.close()
    finally:
        api.close()
        listener.close()
        server.join(5)
