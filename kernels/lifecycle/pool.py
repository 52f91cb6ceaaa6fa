"""A warm pool: sandboxes started ahead of demand, so a new session is ready in milliseconds.

Each pooled session is a complete sandbox (container, kernel, sockets locked, iopub live) that
no one has used. :meth:`WarmPool.acquire` hands one out exactly once and never takes it back:
a session that ran someone's code is never reused. Refilling runs in the background, one
sandbox at a time, so it never competes with running sessions for more than one start; a
failed start is retried after a pause. On close the pool removes every sandbox it holds.

Nothing unaccounted (issue 13): with a session catalog (``store``), each pooled sandbox is
recorded as kind ``pool`` as soon as it has started, and forgotten when it is handed out (the
gateway records it as a session) or removed; a later gateway process re-adopts pool records
into its pool (:meth:`WarmPool.adopt`) or removes them. A refill under way when the pool closes
is never abandoned: the start runs in its own task, shielded from the filler's cancellation,
and the sandbox it produces is removed once it is up (cancelling a start half-way would leave
a container the Docker thread was still creating, with no one to remove it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence

from sandkernel.errors import SandkernelError
from sandkernel.kernels.durable.records import SandboxKind, SandboxRecord
from sandkernel.kernels.durable.store import SessionStore
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.prewarm import prewarm, validate_modules
from sandkernel.kernels.lifecycle.profiles import Profile, resolve_profile

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0


class WarmPool:
    def __init__(
        self,
        size: int,
        profile: Profile | None = None,
        *,
        store: SessionStore | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        """``store``: the session catalog pooled sandboxes are recorded in (None: not recorded);
        ``preload``: modules each pooled kernel imports before it is ready (see prewarm.py)."""
        self.size = size
        self.preload = validate_modules(preload)
        self.profile = profile or resolve_profile()
        self.store = store
        self._ready: collections.deque[KernelSession] = collections.deque()
        self._filler: asyncio.Task | None = None
        self._starting: asyncio.Task | None = None  # the start in flight, in its own (shielded) task
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
            self._starting = asyncio.create_task(self._start_one())
            try:
                session = await asyncio.shield(self._starting)
            except asyncio.CancelledError:
                # close() (or the loop) cancelled the filler mid-start: the start goes on in its
                # own task; remove its sandbox once it is up, so nothing is left running.
                await self._reclaim(self._starting)
                raise
            except SandkernelError as err:
                log.warning("warm pool: a sandbox failed to start (%s); retrying in %gs", err, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            finally:
                self._starting = None
            if self._closed:
                await self._remove(session)
                return
            self._ready.append(session)
            log.info(
                "warm pool: %d/%d ready (started in %.2fs)",
                len(self._ready),
                self.size,
                time.monotonic() - started,
                extra={"session": session.id},
            )

    async def _start_one(self) -> KernelSession:
        """Start one sandbox and record it in the catalog; a sandbox that cannot be recorded is
        removed (a restart would not know it)."""
        session = await KernelSession.start(profile=self.profile)
        if self.preload:
            try:
                await prewarm(session, self.preload)
            except BaseException:
                await session.shutdown()
                raise
        if self.store is not None:
            try:
                await self.store.put(SandboxRecord(session.id, SandboxKind.POOL, session.durable_state()))
            except BaseException:
                await session.shutdown()
                raise
        return session

    async def _reclaim(self, starting: asyncio.Task) -> None:
        """Wait for a start the filler let go of and remove what it started (if it did)."""
        try:
            session = await asyncio.shield(starting)
        except asyncio.CancelledError:
            return  # cancelled again (the loop is going away): the start's own clean-up is all there is
        except Exception as err:  # it failed and cleaned up after itself: nothing to remove
            log.info("warm pool: a start under way when the pool closed failed: %s", err)
            return
        await self._remove(session)

    async def _remove(self, session: KernelSession) -> None:
        """Shut a pooled sandbox down and forget its record."""
        try:
            await session.shutdown()
        finally:
            await self._forget(session)

    async def _forget(self, session: KernelSession) -> None:
        if self.store is None:
            return
        try:
            await self.store.remove(session.id)
        except SandkernelError as err:  # the gateway's put replaces the record anyway; a restart discards it
            log.warning("warm pool: could not remove a catalog record: %s", err, extra={"session": session.id})

    async def wait_full(self, timeout: float = 120.0) -> None:
        """Until the pool holds ``size`` ready sandboxes (for start-up and benchmarks)."""
        deadline = time.monotonic() + timeout
        while len(self._ready) < self.size and time.monotonic() < deadline:
            self._kick()
            await asyncio.sleep(0.05)

    async def acquire(self) -> KernelSession | None:
        """A fresh, never-used sandbox, or None when the pool is empty (the caller starts one).
        Its pool record is removed first: the caller records it as a session."""
        while self._ready:
            session = self._ready.popleft()
            self._kick()
            if await session.kernel_manager.is_alive():
                await self._forget(session)
                self.handed_out += 1
                return session
            log.warning("warm pool: dropped a sandbox whose kernel had died", extra={"session": session.id})
            await self._remove(session)
        self._kick()
        return None

    def adopt(self, session: KernelSession) -> bool:
        """Take back a pooled sandbox a previous process started (already running, already in the
        catalog as kind ``pool``). False when it does not fit (other profile, pool full or
        closed): the caller removes it and its record."""
        if self._closed or not self.matches(session.profile) or len(self._ready) >= self.size:
            return False
        self._ready.append(session)
        return True

    async def close(self) -> None:
        """Stop refilling and remove every pooled sandbox, the one being started included."""
        await self._stop_filling()
        while self._ready:
            await self._remove(self._ready.popleft())

    async def detach(self, grace: float = 5.0) -> None:
        """Stop refilling and let go of the pooled sandboxes, leaving them running and recorded
        for the next gateway process to adopt (a sandbox still starting is removed instead)."""
        await self._stop_filling()
        while self._ready:
            await self._ready.popleft().detach(grace)

    async def _stop_filling(self) -> None:
        self._closed = True
        filler, starting = self._filler, self._starting
        if filler is not None:
            filler.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandkernelError):
                await filler
        if starting is not None and not starting.done():  # the filler was cancelled before it could reclaim
            await self._reclaim(starting)
