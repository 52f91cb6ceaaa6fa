"""Where the ``execute_reply`` of a running execution comes from.

The kernel answers a request on the shell socket it came from. An execution the session sent
itself is answered on the session's own client; one a websocket relayed (so that the client
gets every message exactly as the kernel sent it) is answered on that websocket's socket, and
its relay hands the reply over. The execution tracker asks for it the same way in both cases.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

# A read of the next verified shell message: (timeout seconds) -> message, or raises queue.Empty.
ShellReader = Callable[[float], Awaitable[dict[str, Any]]]


class ReplySource(Protocol):
    async def poll(self, msg_id: str) -> dict[str, Any] | None:
        """The reply's content if it already arrived, without waiting."""

    async def wait(self, msg_id: str, timeout: float) -> dict[str, Any] | None:
        """The reply's content, waiting up to ``timeout`` seconds; None if it did not come."""

    def ended_on_iopub(self) -> None:
        """iopub showed the execution's idle status after :meth:`poll` had found the reply."""


class OwnShellReplies:
    """Replies read from the session's own shell channel (other messages there are stale)."""

    def __init__(self, read_shell: ShellReader) -> None:
        self._read = read_shell
        self._early: dict[str, dict[str, Any]] = {}

    async def poll(self, msg_id: str) -> dict[str, Any] | None:
        if msg_id in self._early:
            return self._early[msg_id]
        while True:
            try:
                msg = await self._read(0)
            except queue.Empty:
                return None
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                self._early = {msg_id: msg["content"]}  # at most one: the running execution's
                return msg["content"]

    async def wait(self, msg_id: str, timeout: float) -> dict[str, Any] | None:
        if msg_id in self._early:
            return self._early.pop(msg_id)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = await self._read(max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                return None
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg["content"]
        return None

    def ended_on_iopub(self) -> None:
        pass


class RelayedReply:
    """A reply the door's relay receives and hands over with :meth:`deliver`."""

    def __init__(self) -> None:
        self._future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    def deliver(self, content: dict[str, Any]) -> None:
        if not self._future.done():
            self._future.set_result(content)

    def abandon(self) -> None:
        """The door's socket is gone: no reply will come. The execution ends on iopub alone
        (its status then comes from its outputs) instead of waiting for a reply."""
        self.deliver({})

    async def poll(self, msg_id: str) -> dict[str, Any] | None:
        return self._future.result() if self._future.done() else None

    async def wait(self, msg_id: str, timeout: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._future), timeout)
        except asyncio.TimeoutError:
            return None

    def ended_on_iopub(self) -> None:
        pass


class OrphanReply:
    """The end of an execution a previous process sent (a gateway restart): its reply went to
    that process's socket and is lost, so a kernel_info request sent on our own shell behind it
    stands in (the kernel answers requests in order). ``ended_unseen`` says iopub never showed
    the execution's end, although the stand-in came: it had already ended while no one watched.
    The stand-in coming first is not enough to say so: iopub can trail the shell (gVisor, and
    more so a savable sandbox's relay, on a loaded host), and its idle then comes after."""

    def __init__(self, read_shell: ShellReader) -> None:
        self.probe_id: str | None = None
        self.ended_unseen = False
        self._own = OwnShellReplies(read_shell)

    async def poll(self, msg_id: str) -> dict[str, Any] | None:
        if self.probe_id is None or await self._own.poll(self.probe_id) is None:
            return None
        self.ended_unseen = True
        return {}

    async def wait(self, msg_id: str, timeout: float) -> dict[str, Any] | None:
        if self.probe_id is None or await self._own.wait(self.probe_id, timeout) is None:
            return None
        return {}  # no status nor count: the outputs say whether it failed

    def ended_on_iopub(self) -> None:
        self.ended_unseen = False
