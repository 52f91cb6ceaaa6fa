"""A warm pool: sandboxes started ahead of demand, so a new session is ready in milliseconds.

Each pooled session is a complete sandbox (container, kernel, sockets locked, iopub live) that
no one has used. :meth:`WarmPool.acquire` hands one out exactly once and never takes it back:
a session that ran someone's code is never reused. Refilling runs in the background, one
sandbox at a time, so it never competes with running sessions for more than one start; a
failed start is retried after a pause. On close the pool removes every sandbox it holds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

from sandkernel.errors import SandkernelError
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.profiles import Profile, resolve_profile

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0


class WarmPool:
    def __init__(self, size: int, profile: Profile | None = None) -> None:
        self.size = size
        self.profile = profile or resolve_profile()
        self._ready: collections.deque[KernelSession] = collections.deque()
        self._filler: asyncio.Task | None = None
        self._closed = False
        self.handed_out = 0

    def __len__(self) -> int:
        return len(self._ready)

    def matches(self, profile: Profile) -> bool:
        """Whether a session of this (fully resolved) profile can take a pooled sandbox."""
        return profile == self.profile

    def start(self) -> None:
        """Begin filling in the background."""
        self._kick()

    def _kick(self) -> None:
        if not self._closed and self.size > 0 and (self._filler is None or self._filler.done()):
            self._filler = asyncio.create_task(self._fill())

    async def _fill(self) -> None:
        while not self._closed and len(self._ready) < self.size:
            started = time.monotonic()
            try:
                session = await KernelSession.start(profile=self.profile)
            except SandkernelError as err:
                log.warning("warm pool: a sandbox failed to start (%s); retrying in %gs", err, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if self._closed:
                await session.shutdown()
                return
            self._ready.append(session)
            log.info(
                "warm pool: %d/%d ready (started in %.2fs)",
                len(self._ready),
                self.size,
                time.monotonic() - started,
                extra={"session": session.id},
            )

    async def wait_full(self, timeout: float = 120.0) -> None:
        """Until the pool holds ``size`` ready sandboxes (for start-up and benchmarks)."""
        deadline = time.monotonic() + timeout
        while len(self._ready) < self.size and time.monotonic() < deadline:
            self._kick()
            await asyncio.sleep(0.05)

    async def acquire(self) -> KernelSession | None:
        """A fresh, never-used sandbox, or None when the pool is empty (the caller starts one)."""
        while self._ready:
            session = self._ready.popleft()
            self._kick()
            if await session.kernel_manager.is_alive():
                self.handed_out += 1
                return session
            log.warning("warm pool: dropped a sandbox whose kernel had died", extra={"session": session.id})
            await session.shutdown()
        self._kick()
        return None

    async def close(self) -> None:
        """Stop refilling and remove every pooled sandbox."""
        self._closed = True
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandkernelError):
                await self._filler
        while self._ready:
            await self._ready.popleft().shutdown()
