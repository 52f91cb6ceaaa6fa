"""Blocking work that makes something, run in a thread, that a cancelled caller cannot leak.

``asyncio.to_thread`` cannot stop its thread: when the awaiting task is cancelled (a warm pool
closing mid-refill, a gateway stopping, a client gone) the thread runs on and makes what it was
making (a container, a loop-mounted disk, a uid reservation) for no one. :func:`made_or_undone`
waits for such work to end even when cancelled, undoes what it made, then lets the
cancellation through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


async def made_or_undone(work: Awaitable[T], undo: Callable[[T], Awaitable[None]]) -> T:
    """Await ``work`` (a coroutine running blocking work in a thread); if the caller is cancelled
    meanwhile, wait for the work to end and ``undo`` its result before re-raising."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            made = await task
            try:
                await undo(made)
            except Exception:
                log.exception("could not undo work its cancelled caller no longer wanted")
        raise
