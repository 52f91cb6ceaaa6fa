"""What a session tells the layers above it: executions, outputs, notes, restarts, its end.

The session layer is the bottom of the stack: it must not call the transcript recorder, the
gateway's metrics or (later) accounting and audit. Instead it emits events, in the style of
nbclient's ``on_cell_*`` hooks, and whoever built the session attaches observers to them (the
gateway attaches the recorder and its metrics to every session, whichever door it serves).

An observer that raises is logged and skipped: a broken observer must never fail, hang or
reorder an execution. Observers are awaited in the order they were added, one event at a time,
so a recorder sees a session's events in the order they happened.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

from sandkernel.kernels.execution.outputs import ExecutionResult

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExecutionRequest:
    """One execution as the session runs it, whichever door it came through.

    ``source`` names the door ("session_api", "websocket", "replay", ...). ``silent`` executions
    (Jupyter's ``silent=True``) run code but leave no cell: observers note them instead.
    """

    code: str
    source: str
    msg_id: str
    timeout: float
    tag: str | None = None
    silent: bool = False
    started_at: str = ""  # ISO 8601, UTC
    # The command, when the door is the shell door: ``code`` is then the cell sandkernel.shell
    # generated for it, and a reviewer judges the command, not that cell.
    shell: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON for the session catalog: what a later process needs to settle it (see
        KernelSession.resume). Every field is a scalar: no ``dataclasses.asdict`` deep copy."""
        return {field: getattr(self, field) for field in _REQUEST_FIELDS}


_REQUEST_FIELDS = tuple(field.name for field in dataclasses.fields(ExecutionRequest))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a gate says of an execution before it runs.

    ``findings`` ride on the result (``policy``: warnings, and the rule behind a refusal);
    ``refusal`` ({"by", "rule", "message"}) means the code does not reach the kernel."""

    findings: tuple[dict[str, Any], ...] = ()
    refusal: dict[str, Any] | None = None


ALLOW = Verdict()


class ExecutionGate(Protocol):
    """Something that judges an execution before it reaches the kernel (the operator's execution
    policy, a session's circuit breaker). Gates are asked in order, before the execute lock is
    taken (a refused execution never waits in the queue); ``request.msg_id`` is still "" then.
    A gate that raises is logged and counts as allowing: the sandbox, not the gate, is the
    security boundary, and a broken reviewer must not stop every session."""

    async def admit(self, request: ExecutionRequest) -> Verdict: ...


class SessionObserver:
    """Base class of session observers: override the events you need; each default does nothing.

    Every method is awaited by the session on its own event loop; keep them short (write-behind
    for slow work, as the transcript recorder does)."""

    async def execution_started(self, request: ExecutionRequest) -> None:
        """The request was sent to the kernel (the session's execute lock is held)."""

    async def output_received(self, request: ExecutionRequest, output: dict[str, Any]) -> None:
        """One output of the running execution, in nbformat shape, after the output budget."""

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        """The execution ended (any status: ok, error, timeout, interrupted, kernel_died, oom)."""

    async def note_added(self, text: str) -> None:
        """Something a reader of the session's record must know (state lost, output discarded,
        a hidden request ran); markdown."""

    async def kernel_restarted(self, reason: str, container_replaced: bool) -> None:
        """The kernel was restarted (on request, by the timeout ladder, after a death)."""

    async def session_closed(self) -> None:
        """The session was shut down; no event follows."""


class Observers:
    """The observers of one session, and the one place their events are dispatched."""

    def __init__(self, session_id: str) -> None:
        self._session_id = session_id
        self._observers: list[SessionObserver] = []

    def add(self, observer: SessionObserver) -> None:
        self._observers.append(observer)

    def remove(self, observer: SessionObserver) -> None:
        if observer in self._observers:
            self._observers.remove(observer)

    def __bool__(self) -> bool:
        return bool(self._observers)

    async def emit(self, event: str, *args: Any) -> None:
        """Await ``event`` on every observer; one that raises is logged, never propagated."""
        for observer in list(self._observers):
            try:
                await getattr(observer, event)(*args)
            except Exception:
                log.exception(
                    "session observer %s failed on %s",
                    type(observer).__name__,
                    event,
                    extra={"session": self._session_id},
                )
