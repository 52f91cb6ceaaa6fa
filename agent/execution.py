"""What one ``run`` returns: the ordered outputs in nbformat shape, plus views people reach for;
and the exceptions raised for an execution that did not end well, which carry it (raised only
when the caller asks: ``run(..., check=True)`` or :meth:`Execution.raise_for_status`; an
exception in the user's code is data in the Execution otherwise, as in E2B's ``run_code``).

Field names follow the gateway's execute reply; the views (``text``, ``stdout``, ``results``,
``images``, ``error``) are what E2B's ``Execution`` users expect to find.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from sandkernel.agent.errors import ClientError
from sandkernel.mime import IMAGE_MIME_TYPES, is_base64


@dataclasses.dataclass(frozen=True)
class ExecutionError:
    """An exception raised by the code in the sandbox."""

    name: str
    value: str
    traceback: list[str]

    def __str__(self) -> str:
        return f"{self.name}: {self.value}"


@dataclasses.dataclass(frozen=True)
class Image:
    """An image the code displayed (e.g. a matplotlib figure), decoded."""

    mime_type: str
    data: bytes


@dataclasses.dataclass(frozen=True)
class Execution:
    # ok | error | timeout | interrupted | kernel_died | oom | restarted (a client's restart) |
    # deleted (the session, while it ran) | detached (see GatewayRestarted) |
    # refused (the gateway's execution policy or a quarantined session refused it: nothing ran)
    status: str
    outputs: list[dict[str, Any]]
    execution_count: int | None
    duration: float
    started_at: str = ""
    text: str = ""
    error: ExecutionError | None = None
    ended_by: str | None = None
    state_lost: str | None = None
    truncation: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The execution policy's findings ({"rule", "action": "warn"|"deny", "message", "line"}): warnings
    # on code that ran, and the denials behind a refusal.
    policy: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Why nothing ran (status ``refused``): {"by": "policy"|"breaker", "rule", "message"}.
    refusal: dict[str, Any] | None = None

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> Execution:
        error = reply.get("error")
        return cls(
            status=reply["status"],
            outputs=list(reply.get("outputs") or []),
            execution_count=reply.get("execution_count"),
            duration=float(reply.get("duration") or 0.0),
            started_at=reply.get("started_at") or "",
            text=reply.get("text") or "",
            error=ExecutionError(error["name"], error["value"], list(error.get("traceback") or [])) if error else None,
            ended_by=reply.get("ended_by"),
            state_lost=reply.get("state_lost"),
            truncation=reply.get("truncation") or {},
            policy=list(reply.get("policy") or []),
            refusal=reply.get("refusal"),
        )

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def refused(self) -> bool:
        """True when the gateway refused the code before it ran (:attr:`refusal` says why)."""
        return self.status == "refused"

    @property
    def warnings(self) -> list[dict[str, Any]]:
        """The policy findings that let the code run but flagged it (action ``warn``)."""
        return [finding for finding in self.policy if finding.get("action") == "warn"]

    @property
    def truncated(self) -> bool:
        """True when the reply was cut to the gateway's output budget (the notebook has it all)."""
        return bool(self.truncation.get("truncated"))

    def _stream(self, name: str) -> str:
        return "".join(o["text"] for o in self.outputs if o["output_type"] == "stream" and o.get("name") == name)

    @property
    def stdout(self) -> str:
        return self._stream("stdout")

    @property
    def stderr(self) -> str:
        return self._stream("stderr")

    @property
    def results(self) -> list[dict[str, Any]]:
        """MIME bundles of display_data and execute_result outputs, in order."""
        return [o.get("data", {}) for o in self.outputs if o["output_type"] in ("display_data", "execute_result")]

    @property
    def images(self) -> list[Image]:
        """The images of :attr:`results` (types in :data:`sandkernel.mime.IMAGE_MIME_TYPES`), decoded:
        SVG is XML text, the rest base64. A value that is not valid base64 is left out."""
        found = []
        for bundle in self.results:
            for mime in IMAGE_MIME_TYPES:
                value = bundle.get(mime)
                if not isinstance(value, str):
                    continue
                try:
                    found.append(Image(mime, base64.b64decode(value) if is_base64(mime) else value.encode()))
                except ValueError:  # binascii.Error: the kernel sent something else
                    continue
        return found

    def raise_for_status(self) -> Execution:
        """Raise the :mod:`~sandkernel.agent.errors` exception for a non-ok status; else return self."""
        if self.ok:
            return self
        if self.status == "detached":  # the gateway let go of it as it stopped: outcome unknown
            raise GatewayRestarted(restart_message(self.ended_by or "gateway_restart"), self)
        detail = str(self.error) if self.error else (self.state_lost or self.status)
        raise EXECUTION_ERRORS.get(self.status, EXECUTION_ERRORS["error"])(f"execution {self.status}: {detail}", self)


def restart_message(how: str, came_back: bool = True, waited: float = 0.0) -> str:
    """What a :class:`GatewayRestarted` says; one sentence for every way an execute loses its gateway."""
    cause = {
        "gateway_restart": "the gateway let go of this execution as it stopped",
        "connection_lost": "the connection to the gateway dropped before the result",
    }.get(how, how)
    back = (
        "the gateway is answering again"
        if came_back
        else f"the gateway did not answer again within {waited:.0f} s (restart_wait)"
    )
    return (
        f"gateway restarted during this execute ({cause}): the code may or may not have run to "
        "completion, and may still be running in the kernel; do not assume it ran once or not at "
        f"all: check the session's state before running it again ({back})"
    )


class GatewayRestarted(ClientError):
    """An execute's gateway went away before its result: the connection dropped (a crash, a
    ``kill -9``), or the gateway let go of the execution as it stopped (status ``detached``).

    Why an exception and not a status like a timeout: nothing says how far the code got. It may
    have run to completion, part way, or (if it was still queued) not at all, and it may still
    be running in the kernel; the client never sends it again by itself. Check the session's
    state (a variable, a file the code writes) before running it again. ``execution`` holds the
    outputs seen before the cut (None when the reply was not streamed); ``came_back`` says
    whether the gateway answered again within the client's ``restart_wait``, so the next call
    can go ahead.
    """

    def __init__(self, message: str, execution: Execution | None = None, came_back: bool = True) -> None:
        super().__init__(message, 0, "gateway_restart")
        self.execution = execution
        self.came_back = came_back


class ExecutionFailed(ClientError):
    """Code ran in the sandbox but did not end ``ok``; ``execution`` holds what it produced."""

    def __init__(self, message: str, execution: Execution) -> None:
        super().__init__(message, 0, execution.status)
        self.execution = execution


class CodeError(ExecutionFailed):
    """The code raised an exception (``execution.error`` has name, value, traceback)."""


class ExecutionTimeoutError(ExecutionFailed, TimeoutError):
    """The code ran past its timeout and was stopped (``execution.ended_by`` says how)."""


class ExecutionInterruptedError(ExecutionFailed):
    """The execution was interrupted (by :meth:`interrupt` or a disconnect)."""


class KernelDiedError(ExecutionFailed):
    """The kernel process died during the execution; its variables are gone."""


class OutOfMemoryError(KernelDiedError, MemoryError):
    """The kernel was killed for using more memory than its profile allows."""


class KernelRestartedError(ExecutionFailed):
    """A restart that a client asked for (``execution.state_lost`` says through which door) ended
    the execution: nobody's code failed; its variables are gone, /workspace is kept."""


class SessionDeletedError(ExecutionFailed):
    """The session was deleted (by a client, its lifetime, the gateway's stop) while the code ran:
    ``execution`` holds the outputs so far; start a new session."""


class ExecutionRefusedError(ExecutionFailed):
    """Nothing ran: the operator's execution policy or the session's circuit breaker refused the
    code (``execution.refusal`` says who, which rule and what to change)."""


EXECUTION_ERRORS: dict[str, type[ExecutionFailed]] = {
    "error": CodeError,
    "timeout": ExecutionTimeoutError,
    "interrupted": ExecutionInterruptedError,
    "kernel_died": KernelDiedError,
    "oom": OutOfMemoryError,
    "refused": ExecutionRefusedError,
    "restarted": KernelRestartedError,
    "deleted": SessionDeletedError,
}
