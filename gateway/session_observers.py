"""What the gateway attaches to every session it creates, whichever door will use it.

The session layer emits events (kernels/execution/events.py); here the gateway's own concerns
hear them: the kernel model's ``execution_state`` and idle clock, the metrics, and the session's
record in the catalog (so a later gateway process can adopt it). The transcript observer comes
from notebooks/observer.py. gateway/wiring.py puts them all on a session, in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sandkernel.kernels.durable.store import SessionStore
from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus

if TYPE_CHECKING:
    from sandkernel.gateway.managed import ManagedSession

log = logging.getLogger(__name__)


class ActivityObserver(SessionObserver):
    """Keeps a session's kernel model busy while any door's execution runs, and its idle clock."""

    def __init__(self, managed: ManagedSession) -> None:
        self.managed = managed

    async def execution_started(self, request: ExecutionRequest) -> None:
        self.managed.touch("busy")

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        self.managed.touch("idle")


class CatalogWriter:
    """Write-behind catalog updates, in order per session, never failing the caller.

    An execution must not wait on the disk, nor fail because the catalog could not be written:
    each update is queued behind the session's previous one (so ``running`` set and cleared land
    in that order) and a failure is logged. :meth:`flush` waits for every queued write (the
    gateway calls it before it closes the store)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.stopping = False  # the gateway is letting go of its sessions (set by the registry)
        self._tails: dict[str, asyncio.Task] = {}
        self._pending: set[asyncio.Task] = set()

    def update(self, session_id: str, **fields: Any) -> None:
        self._chain(session_id, lambda: self.store.update(session_id, **fields))

    def _chain(self, session_id: str, write: Callable[[], Awaitable[None]]) -> None:
        previous = self._tails.get(session_id)

        async def run() -> None:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            try:
                await write()
            except Exception as err:  # a catalog write never fails an execution
                log.warning("catalog write failed: %s", err, extra={"session": session_id})

        task = asyncio.create_task(run())
        self._tails[session_id] = task
        self._pending.add(task)
        task.add_done_callback(self._done(session_id))

    def _done(self, session_id: str) -> Callable[[asyncio.Task], None]:
        def done(task: asyncio.Task) -> None:
            self._pending.discard(task)
            if self._tails.get(session_id) is task:
                del self._tails[session_id]

        return done

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout`` seconds) for every write queued so far."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout)


class CatalogObserver(SessionObserver):
    """Keeps the session's catalog record current: the execution in flight (``running``, set when
    it starts and cleared when it ends, with the last activity in the same write: one write per
    event, two per execution) and the kernel's durable state after a restart (a replaced
    container has a new container id and kernel id)."""

    def __init__(self, managed: ManagedSession, writer: CatalogWriter) -> None:
        self.managed = managed
        self.writer = writer

    async def execution_started(self, request: ExecutionRequest) -> None:
        self.writer.update(self.managed.id, running=request.to_dict())  # with the session's own started_at

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        if result.status is ExecutionStatus.DETACHED and self.writer.stopping:
            # Cut because the gateway stops: the code still runs in the kernel, and the next
            # gateway settles it from ``running``, which is therefore kept.
            self.writer.update(self.managed.id, gateway=self.managed.gateway_record())
            return
        self.writer.update(self.managed.id, running=None, gateway=self.managed.gateway_record())

    async def kernel_restarted(self, reason: str, container_replaced: bool) -> None:
        try:
            state = self.managed.session.durable_state()
        except Exception as err:  # a restart that left no sandbox: the next one records it
            log.warning("cannot record the restarted kernel: %s", err, extra={"session": self.managed.id})
            return
        self.writer.update(self.managed.id, kernel=state)
