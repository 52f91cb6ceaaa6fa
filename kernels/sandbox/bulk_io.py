"""Threads of their own for bulk file work: a snapshot's disk and memory images (hash, copy,
trim, move, remove) and an upload's hash, apart from asyncio's default executor, at a tenant's
CPU weight (service_cpu.place_bulk_thread).

Why (issue 30): that work takes seconds for a large workspace, and it ran on the loop's default
executor (``min(32, cores + 4)`` threads: 6 on a 2-core host), which also carries every other
blocking step of the gateway: transcript writes, accounting walks, snapshot listings, runtime
dirs. A tenant that paused or forked a few large workspaces at once held all of those threads,
and another tenant's execute waited behind them for its transcript write. Here the work has
:data:`BULK_IO_THREADS` threads, and one owner (a tenant) holds at most
:data:`BULK_IO_PER_OWNER` of them at once, so another tenant's pause finds a thread and nothing
else waits for any. An owner's lane exists only while it has work queued or running.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sandkernel.kernels.sandbox.service_cpu import place_bulk_thread

log = logging.getLogger(__name__)
T = TypeVar("T")

BULK_IO_THREADS = 4
BULK_IO_PER_OWNER = 2


class BulkIO:
    """A bounded pool for blocking file work, shared fairly by owners."""

    def __init__(self, threads: int = BULK_IO_THREADS, per_owner: int = BULK_IO_PER_OWNER) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="sandkernel-bulk-io", initializer=_weigh_thread)
        self._per_owner = per_owner
        self._lanes: dict[str, tuple[asyncio.Semaphore, int]] = {}  # owner -> (slots, calls holding or waiting)

    async def run(self, owner: str, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` in one of the pool's threads, once ``owner`` has a free slot."""
        slots, users = self._lanes.get(owner) or (asyncio.Semaphore(self._per_owner), 0)
        self._lanes[owner] = (slots, users + 1)
        try:
            async with slots:
                work = functools.partial(contextvars.copy_context().run, func, *args)
                future = asyncio.get_running_loop().run_in_executor(self._executor, work)
                try:
                    return await asyncio.shield(future)
                except asyncio.CancelledError:
                    # The thread goes on: its slot stays taken until it ends, or a tenant could
                    # pass its share by giving up on its calls (a client that disconnects).
                    await asyncio.wait({future})
                    raise
        finally:
            slots, users = self._lanes[owner]
            if users == 1:
                del self._lanes[owner]
            else:
                self._lanes[owner] = (slots, users - 1)

    def owners(self) -> int:
        """How many owners have work queued or running (a bound the tests check)."""
        return len(self._lanes)


def _weigh_thread() -> None:
    """Each new thread of the pool: into the bulk work's CPU group (see service_cpu.py)."""
    try:
        why_not = place_bulk_thread()
    except OSError as err:
        log.warning("a bulk file thread stays at the gateway's CPU weight: %s", err)
        return
    if why_not is not None:
        log.debug("a bulk file thread stays at the gateway's CPU weight: %s", why_not)


_default: BulkIO | None = None


def bulk_io() -> BulkIO:
    """The process's pool (made on first use)."""
    global _default
    if _default is None:
        _default = BulkIO()
    return _default
