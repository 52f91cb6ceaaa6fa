"""What the server has in flight: the HTTP requests it is serving and its open kernel websockets.

A stopping gateway lets the requests it is serving answer (a cut execution's caller gets its
result) before it lets go of the sessions, and closes every kernel websocket with 1012 so a
Jupyter client reconnects to the next process. Both are the server's concerns, not the session
registry's: the handlers count themselves here (gateway/base.py, the cluster's fast lane) and the
kernel websockets register here (gateway/channels.py); a websocket execute a previous process
left running is answered on them when it ends (gateway/settled_replies.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


class Traffic:
    """The requests in flight (counted) and the open kernel websockets (a set of handlers)."""

    def __init__(self) -> None:
        self.requests_in_flight = 0
        self._no_requests = asyncio.Event()
        self._no_requests.set()
        self.websockets: set[Any] = set()  # open kernel websockets (closed 1012 on a restart)

    def request_started(self) -> None:
        self.requests_in_flight += 1
        self._no_requests.clear()

    def request_ended(self) -> None:
        self.requests_in_flight -= 1
        if self.requests_in_flight <= 0:
            self._no_requests.set()

    async def requests_done(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the HTTP requests being served to answer."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_requests.wait(), timeout)
