"""``--checkpoint-every-cell``: a snapshot of a session's files after each of its cells, so a rewind
(or a fork at a cell) gets the files exactly as they were right after that cell, not as the
re-run cells remake them (``files: "checkpoint"`` instead of ``"replay"``). A savable gVisor
session's (memory snapshots on: ``--memory-snapshots`` auto or on) keeps its memory as well: then
nothing is re-run.

Why a gate as well as an observer: the archive must hold the files as the cell left them, so the
next cell may not start until it is taken. The checkpoint is taken after the reply has gone (the
observer only starts it), and the next execute, by any door, waits for it at admission. Bounded:
the newest ``checkpoints_kept`` per session are kept, and a checkpoint that would pass the
tenant's snapshot quota is skipped (logged; the cell is not failed for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sandkernel.errors import SandkernelError
from sandkernel.kernels.execution.events import ALLOW, ExecutionRequest, SessionObserver, Verdict
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus

if TYPE_CHECKING:
    from sandkernel.gateway.managed import ManagedSession

log = logging.getLogger(__name__)

# What a cell may end as for its files to be worth keeping: a dead kernel's cell left no state.
KEPT_AFTER = frozenset({ExecutionStatus.OK, ExecutionStatus.ERROR, ExecutionStatus.INTERRUPTED})


class CellCheckpoints(SessionObserver):
    """Takes a checkpoint after each recorded cell of one session, and holds the next cell back
    until it is taken (it is also the session's gate). ``take`` is the snapshot manager's
    ``checkpoint`` (gateway/snapshots.py, which builds this observer: given the method, this
    module imports nothing of it)."""

    def __init__(self, take: Callable[[ManagedSession], Awaitable[Any]], managed: ManagedSession) -> None:
        self.take = take
        self.managed = managed
        self._pending: asyncio.Task | None = None

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        if request.silent or result.status not in KEPT_AFTER:
            return
        self._pending = asyncio.create_task(self._take())

    async def _take(self) -> None:
        try:
            await self.take(self.managed)
        except SandkernelError as err:  # the quota, a sandbox that went away: the cell stands
            log.warning("no checkpoint after this cell: %s", err, extra={"session": self.managed.id})

    async def admit(self, request: ExecutionRequest) -> Verdict:
        await self.settled()
        return ALLOW

    async def session_closed(self) -> None:
        await self.settled()

    async def settled(self) -> None:
        """Until the last cell's checkpoint is taken (or failed). A pause waits for it too: its
        sandbox ends with the pause, under a checkpoint still reading it."""
        pending = self._pending
        if pending is not None and not pending.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
