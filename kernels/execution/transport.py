"""The host's ZMQ connection to a sandboxed kernel, bounded because kernel output is untrusted.

Every socket the host opens on a kernel (the session's own client, each websocket's relay)
refuses messages over MAX_MESSAGE_BYTES and holds at most a few messages in its receive queue,
so a kernel that floods output fills its own memory-limited send queue, not the gateway. Messages
that fail verification (code in the kernel holds its key and may send garbage) are dropped and
logged here, never raised into an execution.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import resource
import time
from collections.abc import Iterator
from hmac import compare_digest
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.adapter import adapt
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.session import Session

from sandkernel.kernels.sandbox.kernelspec import SandkernelSpecManager
from sandkernel.logs import Throttle

log = logging.getLogger(__name__)

# The largest single ZMQ message accepted from a kernel (bytes); larger ones drop the connection.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How many kernel messages may wait in our receive queue per shell/control/stdin socket. The
# kernel sends these only in reply to the host's requests, and they are read or drained promptly.
RECEIVE_QUEUE_MESSAGES = 64
# How many kernel messages may wait in the receive queue of each iopub subscriber (ours and each
# websocket's). Kernel output is what untrusted code controls, so this is the bound that counts:
# a subscriber holds at most (IOPUB_RECEIVE_QUEUE + 1) x MAX_MESSAGE_BYTES (the +1 is the message
# ZMQ is decoding), 192 MiB, even when nobody reads; past it, the kernel's own (memory-limited)
# send queue fills and then drops. Ours is drained between executes, so in practice it holds one.
IOPUB_RECEIVE_QUEUE = 2
# How much longer than its timeout one read may wait for a message its poll saw (seconds).
RECEIVE_GRACE_SECONDS = 1.0
# iopub message types that carry output (counted in the "output after the cell returned" note).
OUTPUT_MSG_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result", "error"})


@contextlib.contextmanager
def iopub_receive_queue(context: zmq.Context) -> Iterator[None]:
    """Sockets made inside get the iopub receive queue (IOPUB_RECEIVE_QUEUE messages); the
    context's default is restored after. Our event loop is single-threaded, so nothing else
    makes a socket on this context meanwhile."""
    context.setsockopt(zmq.RCVHWM, IOPUB_RECEIVE_QUEUE)
    try:
        yield
    finally:
        context.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)


class DatelessSession(Session):
    """A jupyter_client Session whose received headers keep their ``date`` as the kernel's string.

    jupyter_client parses every ISO-8601-looking string of each received header and parent
    header into a datetime (``extract_dates``, a regex and dateutil per string, on every
    message of every execute); nothing in sandkernel reads those dates, and the websocket
    relay would only format them back into strings. Everything else (signature check, replay
    refusal, protocol adaptation) is jupyter_client's own, line for line."""

    def deserialize(
        self, msg_list: list[bytes] | list[zmq.Message], content: bool = True, copy: bool = True
    ) -> dict[str, Any]:
        minlen = 5
        if not copy:  # pyzmq did not copy the first parts of the message: copy them now
            msg_list = [bytes(msg.bytes) for msg in msg_list[:minlen]] + list(msg_list[minlen:])  # type: ignore[union-attr]
        parts: list[Any] = list(msg_list)
        if self.auth is not None:
            signature = parts[0]
            if not signature:
                raise ValueError("Unsigned Message")
            if signature in self.digest_history:
                raise ValueError(f"Duplicate Signature: {signature!r}")
            if content:  # only a message that is unpacked, not one peeked at, uses up its signature
                self._add_digest(signature)
            if not compare_digest(signature, self.sign(parts[1:5])):
                raise ValueError(f"Invalid Signature: {signature!r}")
        if len(parts) < minlen:
            raise TypeError(f"malformed message, must have at least {minlen} elements")
        header = self.unpack(parts[1])
        buffers = [memoryview(b) for b in parts[5:]]
        if buffers and buffers[0].shape is None:  # pyzmq #646: force a copy
            buffers = [memoryview(bytes(b.bytes)) for b in parts[5:]]
        message = {
            "header": header,
            "msg_id": header["msg_id"],
            "msg_type": header["msg_type"],
            "parent_header": self.unpack(parts[2]),
            "metadata": self.unpack(parts[3]),
            "content": self.unpack(parts[4]) if content else parts[4],
            "buffers": buffers,
        }
        return adapt(message)


# One throttle for the process (not one per session, which a flood of sessions would multiply).
DROPPED = Throttle()
DEFAULT_CONTEXT_SOCKETS = 1023  # libzmq's ZMQ_MAX_SOCKETS default
_CONTEXT: zmq.asyncio.Context | None = None


def shared_context() -> zmq.asyncio.Context:
    """The one ZMQ context of every kernel manager in this process. A context costs two native
    threads (libzmq's I/O thread and its reaper): one per session made 400 threads for 200 idle
    sessions (bench/density.py). Its sockets refuse oversized messages from the kernel (kernel
    output is untrusted, and one 1 GB message would otherwise sit in host memory), and a flooding
    kernel queues in its own (memory-limited) send buffer, not in ours: when the queue is full PUB
    drops messages, which the shell-reply fallback of the execute covers. A kernel manager given
    a context never destroys it (jupyter_client destroys only the contexts it created)."""
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT.closed:
        _CONTEXT = zmq.asyncio.Context()
        _CONTEXT.set(zmq.MAX_SOCKETS, context_socket_limit(_CONTEXT.get(zmq.SOCKET_LIMIT)))
        _CONTEXT.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        _CONTEXT.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
    return _CONTEXT


def context_socket_limit(libzmq_limit: int) -> int:
    """The sockets the shared context may hold: what the process's open-file limit allows (two
    descriptors per socket: its own and its connection's), never below libzmq's default of 1023.
    That default was a budget per session while each had its own context; shared, 1023 made the
    whole gateway's limit (~200 sessions at 5 sockets each, fewer with websockets open), and one
    tenant's websockets could have used up every other tenant's room."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    by_files = libzmq_limit if soft == resource.RLIM_INFINITY else soft // 2
    return max(DEFAULT_CONTEXT_SOCKETS, min(libzmq_limit, by_files))


def new_kernel_manager(kernel_name: str) -> AsyncKernelManager:
    """A kernel manager on the :func:`shared_context`, whose session (and so every client and
    relay made from it) is a :class:`DatelessSession`."""
    km = AsyncKernelManager(
        kernel_name=kernel_name, kernel_spec_manager=SandkernelSpecManager(), context=shared_context()
    )
    km.session = DatelessSession(parent=km)
    return km


def connect_iopub(km: AsyncKernelManager) -> zmq.asyncio.Socket:
    """A new iopub subscriber on ``km``'s kernel with the bounded receive queue (the gateway's
    websocket relay makes one per connection)."""
    with iopub_receive_queue(km.context):
        return km.connect_iopub()


def new_client(km: AsyncKernelManager) -> AsyncKernelClient:
    """The session's own client of ``km``'s kernel, channels started, iopub bounded. A fresh
    client is also how a cut iopub subscription is renewed (see KernelSession)."""
    client = km.client(context=km.context)
    with iopub_receive_queue(km.context):
        client.iopub_channel.start()
    # No heartbeat channel: its thread pinged every second per session and nothing reads it (a
    # client made by the manager asks the manager in is_alive(), never the heartbeat).
    client.start_channels(hb=False)
    return client


async def next_message(client: AsyncKernelClient, channel: str, timeout: float, session_id: str) -> dict[str, Any]:
    """The next message on ``client``'s iopub or shell that passes verification; raises queue.Empty.

    Mis-signed or malformed frames are dropped and logged (they come from untrusted code), never
    raised into the execute path (where they would fail the caller's request)."""
    get = client.get_iopub_msg if channel == "iopub" else client.get_shell_msg
    deadline = time.monotonic() + timeout
    while True:
        remaining = max(deadline - time.monotonic(), 0)
        try:
            # jupyter_client polls for the timeout, then receives without one: if another reader
            # of the socket took the message the poll saw (a restart's readiness probe beside a
            # running execute), that receive would wait forever. Every read is bounded.
            return await asyncio.wait_for(get(timeout=remaining), remaining + RECEIVE_GRACE_SECONDS)
        except asyncio.TimeoutError:
            raise queue.Empty from None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            if (skipped := DROPPED.allow()) is not None:
                log.warning(
                    "dropped a %s message that failed verification: %s (%d more not logged)",
                    channel,
                    str(err)[:200],
                    skipped,
                    extra={"session": session_id},
                )
            if time.monotonic() >= deadline:
                raise queue.Empty from None


def is_our_output(frames: list[zmq.Frame], our_session: str) -> bool:
    """Whether a raw iopub message is output answering one of our own requests. Only the small
    header frames are parsed (never the content); a message that does not parse is not ours."""
    try:
        delim = next(i for i, frame in enumerate(frames) if len(frame) == 9 and frame.bytes == b"<IDS|MSG>")
        header, parent = frames[delim + 2], frames[delim + 3]
        if len(header) > 65536 or len(parent) > 65536:
            return False
        msg_type = json.loads(header.bytes).get("msg_type")
        return msg_type in OUTPUT_MSG_TYPES and json.loads(parent.bytes).get("session") == our_session
    except (StopIteration, IndexError, ValueError, AttributeError):
        return False
