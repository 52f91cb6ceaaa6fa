"""A warm pool: sandboxes started ahead of demand, so a new session is ready in milliseconds.

Each pooled session is a complete sandbox (container, kernel, sockets locked, iopub live) that
no one has used. :meth:`WarmPool.acquire` hands one out exactly once and never takes it back:
a session that ran someone's code is never reused. On close the pool removes every sandbox it
holds.

Sizing follows demand (issue 17). ``size`` is the floor the pool keeps ready; ``max_size`` its
ceiling. Every acquire (served or not: a miss is demand too) is remembered for
``demand_window`` seconds, and the pool aims at ``size`` plus that many, up to the ceiling: a
burst that drains the pool makes it grow, so the next burst is served warm, and once the window
passes without acquires the surplus idle sandboxes are removed (never a handed-out one: the
pool forgets those). Growth beyond the floor also needs room in the gateway (``room``: how many
more sandboxes ``max_sessions_total`` allows); the floor itself is reserved there, and a
session that needs room takes it from the surplus, ready or still starting (release_surplus).
Refills run ``concurrency`` starts at a time (matched to the host's cores by the gateway's
settings), so a refill never takes the host from live sessions for more than that; a failed
start pauses every refill for ``RETRY_SECONDS``.

Nothing unaccounted (issue 13): with a session catalog (``store``), each pooled sandbox is
recorded as kind ``pool`` as soon as it has started, and forgotten when it is handed out (the
gateway records it as a session) or removed; a later gateway process re-adopts pool records
into its pool (:meth:`WarmPool.adopt`) or removes them. A start under way when the pool closes
is never abandoned: each start runs in its own task, which the tending loop's cancellation does
not reach, and a start that ends after the close removes its sandbox itself (cancelling a start
half-way would leave a container the Docker thread was still creating, with no one to remove it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from sandkernel.errors import ConfigError, SandkernelError
from sandkernel.kernels.durable.store import SessionStore
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.prewarm import prewarm, validate_modules
from sandkernel.kernels.model.profiles import Profile, resolve_profile
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0
# Seconds an acquire counts as demand: the pool shrinks back to its floor this long after the last.
DEMAND_WINDOW = 120.0


class WarmPool:
    def __init__(
        self,
        size: int,
        profile: Profile | None = None,
        *,
        store: SessionStore | None = None,
        preload: Sequence[str] = (),
        max_size: int | None = None,
        concurrency: int = 1,
        demand_window: float = DEMAND_WINDOW,
        savable: bool = False,
    ) -> None:
        """``size``: sandboxes kept ready (the floor); ``max_size``: the most it grows to under
        demand (None: ``size``, a fixed pool); ``concurrency``: sandboxes started at once when
        refilling; ``demand_window``: seconds an acquire counts as demand; ``store``: the session
        catalog pooled sandboxes are recorded in (None: not recorded); ``preload``: modules each
        pooled kernel imports before it is ready (see prewarm.py); ``savable``: its sandboxes start
        savable (gVisor memory snapshots), as the gateway's sessions of its profile do."""
        max_size = size if max_size is None else max_size
        if size < 0 or max_size < size:
            raise ConfigError(f"a warm pool's ceiling ({max_size}) must be at least its size ({size})")
        if concurrency < 1:
            raise ConfigError(f"a warm pool starts at least one sandbox at a time, not {concurrency}")
        self.size = size
        self.max_size = max_size
        self.concurrency = concurrency
        self.demand_window = demand_window
        self.preload = validate_modules(preload)
        self.profile = profile or resolve_profile()
        self.savable = savable
        self.store = store
        # How many more sandboxes the gateway has room for beyond what the pool holds (the
        # registry sets it: max_sessions_total); only growth beyond the floor asks.
        self.room: Callable[[], int] = lambda: max_size
        self._ready: collections.deque[KernelSession] = collections.deque()
        self._starting: set[asyncio.Task] = set()  # each start in its own task (never cancelled)
        self._removing: set[asyncio.Task] = set()  # surplus sandboxes being removed (still occupying)
        # Sandboxes whose room went to a session (release_surplus): ready ones being removed, and
        # starts that remove their sandbox when they end. The session's own count holds their room.
        self._yielding: set[asyncio.Task] = set()
        self._doomed: set[asyncio.Task] = set()  # a subset of _starting
        self._acquires: collections.deque[float] = collections.deque()  # monotonic times, within the window
        self._tender: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._retry_at = 0.0  # no start before this (monotonic): a start failed
        self._closed = False
        self.handed_out = 0

    def __len__(self) -> int:
        return len(self._ready)

    @property
    def held(self) -> int:
        """Sandboxes the pool keeps: ready and starting, less the starts whose room went to a
        session (they remove their sandbox when they end)."""
        return len(self._ready) + len(self._starting) - len(self._doomed)

    @property
    def removing(self) -> int:
        """Surplus sandboxes being removed that no session took the room of: their containers
        still exist, so they count toward the gateway's total until gone."""
        return len(self._removing)

    @property
    def occupying(self) -> int:
        """What the pool occupies of ``max_sessions_total``: what it keeps and what it is removing."""
        return self.held + self.removing

    def matches(self, profile: Profile) -> bool:
        """Whether a session of this (fully resolved) profile can take a pooled sandbox."""
        return profile == self.profile

    def target(self) -> int:
        """How many sandboxes the pool aims to hold now: the floor plus the recent demand, up to
        the ceiling."""
        horizon = time.monotonic() - self.demand_window
        while self._acquires and self._acquires[0] < horizon:
            self._acquires.popleft()
        return min(self.max_size, self.size + len(self._acquires))

    def start(self) -> None:
        """Begin filling in the background."""
        self._kick()

    def _kick(self) -> None:
        if self._closed or self.max_size == 0:
            return
        if self._tender is None or self._tender.done():
            self._tender = asyncio.create_task(self._tend())
        self._wake.set()

    async def _tend(self) -> None:
        """Keep the pool at its target: start sandboxes (``concurrency`` at a time) while it holds
        fewer, remove idle surplus ones when it holds more; look again on every acquire, start
        and failure, and at least every quarter of the demand window (demand expires)."""
        while not self._closed:
            self._wake.clear()
            target = self.target()
            now = time.monotonic()
            while (
                self.held < target
                and len(self._starting) < self.concurrency
                and now >= self._retry_at
                and (self.held < self.size or self.room() > 0)
            ):
                task = asyncio.create_task(self._start_and_keep())
                self._starting.add(task)
                task.add_done_callback(self._started)
            while len(self._ready) > target:
                self._discard(self._ready.pop())  # the newest: the oldest go out first on acquire
            wait = max(0.05, min(self.demand_window / 4, self._retry_at - now if self._retry_at > now else 3600))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def _started(self, task: asyncio.Task) -> None:
        self._starting.discard(task)
        self._doomed.discard(task)
        self._wake.set()

    def _discard(self, session: KernelSession, into: set[asyncio.Task] | None = None) -> None:
        """Remove a surplus pooled sandbox in the background, tracked in ``into`` (``_removing``
        by default; close waits for both sets)."""
        tasks = self._removing if into is None else into
        task = asyncio.create_task(self._remove(session))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        log.info("warm pool: removing a surplus sandbox (target %d)", self.target(), extra={"session": session.id})

    async def _start_and_keep(self) -> None:
        """One refill: start a sandbox and add it to the pool, or remove it if the pool closed
        meanwhile or its room went to a session (release_surplus); any failure pauses refills for
        RETRY_SECONDS (an unexpected one too: without the pause the pool would start containers
        in a tight loop)."""
        started = time.monotonic()
        try:
            session = await self._start_one()
        except Exception as err:
            log.warning(
                "warm pool: a sandbox failed to start (%s); retrying in %gs",
                err,
                RETRY_SECONDS,
                exc_info=not isinstance(err, SandkernelError),
            )
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return
        if self._closed or asyncio.current_task() in self._doomed:
            await self._remove(session)
            return
        # Out of the starting set in the same step as into the ready queue: the task's done
        # callback comes a loop turn later, and meanwhile ``held`` would count this sandbox twice
        # (seen once as 4 sandboxes held under a ceiling of 3, and it would refuse a session).
        self._starting.discard(asyncio.current_task())  # type: ignore[arg-type]
        self._ready.append(session)
        log.info(
            "warm pool: %d/%d ready (started in %.2fs)",
            len(self._ready),
            self.target(),
            time.monotonic() - started,
            extra={"session": session.id},
        )

    async def _start_one(self) -> KernelSession:
        """Start one sandbox and record it in the catalog; a sandbox that cannot be recorded is
        removed (a restart would not know it)."""
        session = await KernelSession.start(profile=self.profile, savable=self.savable)
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
        """Until the pool holds ``size`` ready sandboxes, its floor (for start-up and benchmarks)."""
        deadline = time.monotonic() + timeout
        while len(self._ready) < self.size and time.monotonic() < deadline:
            self._kick()
            await asyncio.sleep(0.05)

    async def acquire(self) -> KernelSession | None:
        """A fresh, never-used sandbox, or None when the pool is empty (the caller starts one).
        Its pool record is removed first: the caller records it as a session. Every call counts
        as demand, served or not."""
        self._acquires.append(time.monotonic())
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

    def release_surplus(self, count: int) -> int:
        """Give up to ``count`` sandboxes beyond the floor back to the gateway (a session needs
        their room under ``max_sessions_total``); returns how many were let go. Ready ones go
        first, removed in the background; then starts under way, which remove their sandbox when
        they end (a pool growing at the limit gives way to sessions too)."""
        freed = 0
        while freed < count and self.held > self.size:
            if self._ready:
                self._discard(self._ready.pop(), self._yielding)
            else:  # held > size >= 0 with none ready: a start not yet doomed exists
                self._doomed.add(next(t for t in self._starting if t not in self._doomed))
            freed += 1
        return freed

    async def removals_done(self) -> None:
        """Wait for the sandboxes whose room went to sessions to be gone (a cold start that took
        their room waits, so the gateway never holds more containers than
        ``max_sessions_total``); other removals count as occupied meanwhile and need no wait."""
        while self._yielding or self._doomed:
            await asyncio.wait({*self._yielding, *self._doomed})

    def adopt(self, session: KernelSession) -> bool:
        """Take back a pooled sandbox a previous process started (already running, already in the
        catalog as kind ``pool``). False when it does not fit (other profile, pool at its floor
        or closed): the caller removes it and its record."""
        if self._closed or not self.matches(session.profile) or len(self._ready) >= self.size:
            return False
        self._ready.append(session)
        return True

    async def close(self) -> None:
        """Stop refilling and remove every pooled sandbox, those being started included."""
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
        """Stop the tending loop, then wait for the starts under way (each removes its sandbox,
        the pool being closed) and the surplus removals."""
        self._closed = True
        tender = self._tender
        if tender is not None:
            tender.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandkernelError):
                await tender
        while self._starting or self._removing or self._yielding:
            # wait, unlike gather, never cancels them
            await asyncio.wait({*self._starting, *self._removing, *self._yielding})
