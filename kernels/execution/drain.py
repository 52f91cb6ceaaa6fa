"""Between executions, the session's own channels are read by nobody: the drain reads them.

A background thread in the kernel may keep printing after its cell returned, and stale replies
may arrive; unread, they would sit in the host's receive queues (up to the queue bounds of
transport.py) for as long as the session lives. The drain discards them while no execution
reads, and counts the output answering the session's own requests for a transcript note.
Output answering a websocket client's request is its relay's to show, not counted here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient

from sandkernel.kernels.execution.transport import IOPUB_RECEIVE_QUEUE, RECEIVE_QUEUE_MESSAGES, is_our_output

# How long the drain sleeps when its session has no client to read (a restart or replacement
# in progress: transient), before looking again (seconds).
NO_CLIENT_SECONDS = 1.0
# The longest one wait for kernel messages lasts (seconds). A wait ends as soon as a message
# arrives, a reader takes the channels, or the channels are closed (pyzmq cancels a poll on a
# socket it closes): this bound is only a backstop, so an idle session costs its gateway nothing
# but a wake-up this rarely (with a 1 s poll, 200 idle sessions cost 200 wake-ups a second).
DRAIN_POLL_SECONDS = 60.0


class IdleDrain:
    """Discards what the kernel sends on the session's channels while nothing reads them.

    Owned by one session: :meth:`start` with the kernel, :meth:`stop` at shutdown. Readers hold
    :meth:`reading` for as long as they read the channels themselves."""

    def __init__(self, session_id: str, current_client: Callable[[], AsyncKernelClient | None]) -> None:
        self._session_id = session_id
        self._current_client = current_client
        self._readers = 0
        self._free = asyncio.Event()
        self._free.set()
        self._task: asyncio.Task | None = None
        # Resolved when a reader takes the channels: the drain's wait ends at once, so it never
        # holds a poll on sockets a reader uses or a restart is about to close.
        self._wake: asyncio.Future[None] | None = None
        self._discarded = [0, 0]  # output messages, bytes thrown away since the last take

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Held while something of the session reads the kernel's channels: the drain keeps off."""
        self._readers += 1
        self._free.clear()
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        try:
            yield
        finally:
            self._readers -= 1
            if not self._readers:
                self._free.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sandkernel-drain-{self._session_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def take_discarded(self) -> tuple[int, int]:
        """(output messages, bytes) discarded since the last call, and reset the count."""
        (messages, size), self._discarded = self._discarded, [0, 0]
        return messages, size

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._free.wait()
            client = self._current_client()
            if client is None or client.iopub_channel.socket is None or client.shell_channel.socket is None:
                await asyncio.sleep(NO_CLIENT_SECONDS)
                continue
            poller = zmq.asyncio.Poller()
            channels = {client.iopub_channel.socket: "iopub", client.shell_channel.socket: "shell"}
            for sock in channels:
                poller.register(sock, zmq.POLLIN)
            self._wake = loop.create_future()
            try:
                polling = poller.poll(DRAIN_POLL_SECONDS * 1000)
            except zmq.ZMQError:  # the channels were closed under us (restart, replacement)
                await asyncio.sleep(NO_CLIENT_SECONDS)
                continue
            try:
                await asyncio.wait((polling, self._wake), return_when=asyncio.FIRST_COMPLETED)
            finally:
                polling.cancel()  # a no-op once done; else it unregisters from the sockets
                self._wake = None
            # No await from here on: an execute cannot start reading while we discard.
            if self._readers or self._current_client() is not client or not polling.done() or polling.cancelled():
                continue
            if polling.exception() is not None:  # the channels were closed under us
                await asyncio.sleep(NO_CLIENT_SECONDS)
                continue
            for sock, _ in polling.result():
                self._discard_ready(sock, channels[sock] == "iopub", client.session.session)

    def _discard_ready(self, sock: zmq.asyncio.Socket, count_output: bool, our_session: str) -> None:
        """Discard the messages ``sock`` holds now (without waiting), counting our output.

        EVENTS is checked before each receive so no ``zmq.Again`` is raised: pyzmq keeps a raised
        exception in a future whose reference cycle would hold our frame, and with it the last
        60 MB message, until the garbage collector ran."""
        for _ in range(IOPUB_RECEIVE_QUEUE + RECEIVE_QUEUE_MESSAGES):
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(flags=zmq.DONTWAIT, copy=False).result()
            except zmq.ZMQError:
                return
            if count_output and is_our_output(frames, our_session):
                self._discarded[0] += 1
                self._discarded[1] += sum(len(frame) for frame in frames)
