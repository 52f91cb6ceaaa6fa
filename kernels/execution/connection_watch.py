"""Whether a kernel's shell connection stayed up since the kernel was last found alive.

Why: a savable sandbox's kernel is a gVisor guest behind its supervisor's relay
(kernel-image/kernel_supervisor.py), and asking whether it lives means a connection through that
relay, made before every execute: about half of what memory snapshots add to an execute
(docs/snapshots.md). The relay joins each of the host's connections to the kernel's own socket
and closes it as soon as the kernel's end closes, so a kernel that dies, restarts or is detached
for a checkpoint ends the host's shell connection, and ZMQ reports that (and any reconnection)
on the socket's monitor. No event since a probe found the kernel alive means the kernel that
answered then still holds the other end, and the probe can be skipped.

A kernel that dies just before an execute is sent, before libzmq has seen its connection end,
is caught the way a kernel that dies during a cell is: by the execution's own watch.
"""

from __future__ import annotations

import contextlib
import itertools

import zmq

_names = itertools.count()


class ShellConnectionWatch:
    """Connection events of one ZMQ socket, drained without waiting."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        address = f"inproc://sandkernel-connection-watch-{id(self)}-{next(_names)}"
        socket.monitor(address, zmq.EVENT_ALL)
        # A plain (blocking-API) socket on the same libzmq context: read with NOBLOCK, no loop.
        self._events = zmq.Context.shadow(socket.context.underlying).socket(zmq.PAIR)
        self._events.connect(address)
        self._confirmed = False

    def steady(self) -> bool:
        """True while no connection event came since :meth:`confirm` (every event is drained: an
        event makes the next probe necessary, whatever it was)."""
        while True:
            try:
                self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self._confirmed
            self._confirmed = False

    def confirm(self) -> None:
        """A probe found the kernel alive (after :meth:`steady` drained what came before it)."""
        self._confirmed = True

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._events.close(linger=0)
