"""A byte bound on what the kernel holds for iopub readers that fall behind.

ZMQ bounds a socket's send queue in messages (start_kernel.IOPUB_SEND_QUEUE), not in bytes, and
ipykernel puts every message a thread sends on an unbounded deque before its I/O thread hands it
to ZMQ. A cell that keeps displaying 60 MB blobs from a thread while the host reads slowly (a
loaded machine, a paused client) piled up gigabytes there and ended in an OOM kill: the tenant's
own kernel died of output nobody could read.

Here every large message (at least LARGE_MESSAGE_BYTES) is counted from the moment a thread sends
it until ZMQ lets go of its buffer (a pyzmq MessageTracker: written to the socket, or dropped at
the high-water mark). A large message that would take the count past QUEUED_BYTES is dropped at
once, as ZMQ drops past its queue: output is never blocked on, so a slow reader cannot stall the
tenant's code. Small messages keep ZMQ's message bound alone (64 x 1 MiB at most).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

LARGE_MESSAGE_BYTES = 1 << 20
# Two of the largest messages the host accepts (64 MiB, kernels/execution/transport.py), so any one
# output still goes through when the reader keeps up; within every profile's memory.
QUEUED_BYTES = 128 << 20

logger = logging.getLogger(__name__)


def message_bytes(parts: Sequence[Any]) -> int:
    """The size of a multipart message (bytes, memoryviews or zmq Frames)."""
    return sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)


class QueuedMessage:
    """One admitted large message: counted until released, or until its tracker is done."""

    __slots__ = ("released", "size", "tracker")

    def __init__(self, size: int) -> None:
        self.size = size
        self.tracker: Any = None  # zmq.MessageTracker once handed to ZMQ
        self.released = False

    @property
    def held(self) -> bool:
        return not self.released and (self.tracker is None or not self.tracker.done)


class QueuedBytes:
    """The large messages sent and not yet let go of by ZMQ; used from any thread."""

    def __init__(self, budget: int = QUEUED_BYTES) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._messages: list[QueuedMessage] = []

    def admit(self, size: int) -> QueuedMessage | None:
        """Count a message of ``size`` bytes, or None when it would pass the budget (drop it)."""
        with self._lock:
            self._messages = [m for m in self._messages if m.held]
            if sum(m.size for m in self._messages) + size > self.budget:
                return None
            message = QueuedMessage(size)
            self._messages.append(message)
            return message

    def held_bytes(self) -> int:
        with self._lock:
            return sum(m.size for m in self._messages if m.held)


def bound_iopub_bytes(queued: QueuedBytes | None = None) -> QueuedBytes:
    """Wrap ipykernel's IOPubThread.send_multipart with the bound (see the module docstring)."""
    import zmq
    from ipykernel.iostream import CHILD, IOPubThread

    queued = queued or QueuedBytes()
    send_multipart = IOPubThread.send_multipart
    really_send = IOPubThread._really_send

    def send_tracked(self: IOPubThread, message: QueuedMessage, parts: Any, kwargs: dict[str, Any]) -> None:
        """On the I/O thread: hand the parts to ZMQ without a copy, keeping the tracker."""
        try:
            if self.closed or self._check_mp_mode() == CHILD:
                really_send(self, parts, **kwargs)  # shutting down, or a forked child: ipykernel's own path
            else:
                message.tracker = self.socket.send_multipart(parts, **{**kwargs, "copy": False, "track": True})
        except (AttributeError, zmq.ZMQError) as err:
            if isinstance(err, zmq.ZMQError) and err.errno != zmq.ENOTSOCK:
                raise
            logger.debug("iopub socket closed during send: %s", err)  # as ipykernel's _really_send
        finally:
            if message.tracker is None:
                message.released = True

    def bounded_send_multipart(self: IOPubThread, parts: Any, *args: Any, **kwargs: Any) -> None:
        size = message_bytes(parts)
        if args or size < LARGE_MESSAGE_BYTES:
            send_multipart(self, parts, *args, **kwargs)
            return
        message = queued.admit(size)
        if message is not None:
            self.schedule(lambda: send_tracked(self, message, parts, kwargs))

    IOPubThread.send_multipart = bounded_send_multipart
    return queued
