"""The kernel's byte bound on large iopub messages (kernel-image/iopub_budget.py), on the host with
the real ipykernel I/O thread and real ZMQ sockets: a reader that does not read holds at most the
budget in the kernel, and what it then reads frees the budget for more. The same bound in a
sandbox, under both runtimes, is tested in tests/test_kernel_image.py."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel-image"))
from iopub_budget import LARGE_MESSAGE_BYTES, QueuedBytes, bound_iopub_bytes, message_bytes

MIB = 1 << 20


class Tracker:
    def __init__(self) -> None:
        self.done = False


def test_the_budget_admits_until_full_and_frees_what_zmq_let_go():
    queued = QueuedBytes(budget=8 * MIB)
    first, second = queued.admit(5 * MIB), queued.admit(3 * MIB)
    assert first is not None and second is not None
    assert queued.admit(1) is None, "a byte past the budget is refused"
    first.tracker = Tracker()
    assert queued.admit(MIB) is None, "a message ZMQ still holds is counted"
    first.tracker.done = True
    assert queued.admit(5 * MIB) is not None, "a message ZMQ let go of is not"
    second.released = True  # never handed to ZMQ (the socket had closed)
    assert queued.held_bytes() == 5 * MIB


def test_message_bytes_counts_every_kind_of_part():
    assert message_bytes([b"ab", memoryview(b"cde"), zmq.Frame(b"fghi")]) == 9


@pytest.fixture
def iopub(monkeypatch):
    """ipykernel's IOPubThread on a PUB socket with a subscriber that reads only when told, and
    the bound (8 MiB) on it; IOPubThread's own send_multipart is put back afterwards."""
    from ipykernel.iostream import IOPubThread

    monkeypatch.setattr(IOPubThread, "send_multipart", IOPubThread.send_multipart)
    context = zmq.Context()
    address = f"inproc://iopub-{uuid.uuid4().hex}"
    pub = context.socket(zmq.PUB)
    pub.bind(address)
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    thread = IOPubThread(pub)
    thread.start()
    queued = bound_iopub_bytes(QueuedBytes(budget=8 * MIB))
    try:
        yield thread, sub, queued
    finally:
        thread.stop()
        thread.close()
        sub.close(linger=0)
        context.term()


def flushed(thread) -> None:
    """Wait until the I/O thread has handed everything sent so far to ZMQ (its events run in order)."""
    done = threading.Event()
    thread.schedule(done.set)
    assert done.wait(30), "the iopub thread did not run its queue"


def released_by_zmq(queued: QueuedBytes, bound: float = 30) -> None:
    """Wait until ZMQ let go of every message read (pyzmq marks a tracker done from its own
    garbage-collection thread, a moment after the reader's copy)."""
    deadline = time.monotonic() + bound
    while queued.held_bytes():
        assert time.monotonic() < deadline, f"ZMQ still holds {queued.held_bytes()} bytes that were read"
        time.sleep(0.01)


def test_a_reader_that_does_not_read_holds_the_budget_and_no_more(iopub):
    thread, sub, queued = iopub
    size = 2 * MIB - 64  # with its topic, four fit the budget and a fifth does not
    for n in range(10):
        thread.send_multipart([b"display", bytes([n]) * size], copy=False)
    thread.send_multipart([b"stream", b"small messages are ZMQ's to bound"])
    flushed(thread)
    assert queued.held_bytes() == 4 * (size + len(b"display")), "the budget holds four 2 MiB messages"
    received = [sub.recv_multipart() for _ in range(5)]
    assert [m[1][:1] for m in received[:4]] == [bytes([n]) for n in range(4)], "the first four, in order"
    assert received[4] == [b"stream", b"small messages are ZMQ's to bound"], "a small message is never dropped"
    assert sub.poll(100) == 0, "the six past the budget were dropped"
    released_by_zmq(queued)
    thread.send_multipart([b"display", b"y" * size], copy=False)
    flushed(thread)
    assert sub.recv_multipart()[1] == b"y" * size, "what the reader took frees the budget"
    assert size >= LARGE_MESSAGE_BYTES
