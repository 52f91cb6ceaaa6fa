"""The session service: the one way every door runs code in a session and acts on its kernel.

The session API (whole and streamed executes, its shell endpoint, interrupt, restart), the
kernel API's websocket and REST actions, and MCP's tools (over HTTP and stdio) are protocol
translation only: each turns its request into one call here and renders what comes back in its
own shape. What every door must do the same way is done here, once:

- **input checks**: the code is a string within :data:`MAX_CODE_BYTES` (a websocket's within that
  door's own bounds), the timeout is a positive number within the session's ceiling, a shell
  command is a non-empty line within its size;
- **activity**: the session's idle clock is touched when a call arrives, files and variables
  included (busy / idle then follow the execution itself: gateway/session_observers.py);
- **the output budget**: a whole reply is cut to the gateway's budget here (:meth:`reply`), and
  a truncated one counted in the metrics once, whichever door asked.

Which observers and gates every session carries, in which order, is declared in one place too
(gateway/wiring.py); a door never adds one. Sessions are found by the registry (a lookup
table: get, find, by kernel), which the doors still ask; the service acts on what it found.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sandkernel.doors import CLIENT_DOORS
from sandkernel.errors import ConfigError
from sandkernel.gateway.budget import OutputBudget, apply_budget
from sandkernel.gateway.managed import ManagedSession
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.kernels.execution.outputs import ExecutionResult, OutputCallback
from sandkernel.kernels.execution.replies import RelayedReply
from sandkernel.kernels.execution.session import MAX_EXECUTE_TIMEOUT, check_timeout
from sandkernel.output_text import readable_text
from sandkernel.shell import execution_timeout, output_limit, shell_code, shell_result

MAX_CODE_BYTES = 1024 * 1024  # one cell's source; larger code is uploaded as a file and run
MAX_COMMAND_BYTES = 256 * 1024  # one shell command line


class BadCodeError(ConfigError):
    """The code of an execute is not a string of source."""

    code = "bad_code"


class CodeTooLargeError(ConfigError):
    """The code of an execute is over :data:`MAX_CODE_BYTES`."""

    status = 413
    code = "request_entity_too_large"  # the code this reply has always carried


def checked_code(code: object) -> str:
    """The source a door was sent, or the error that says what to send instead."""
    if not isinstance(code, str):
        raise BadCodeError("'code' must be a string of Python source")
    if len(code.encode()) > MAX_CODE_BYTES:
        raise CodeTooLargeError(
            f"code is larger than {MAX_CODE_BYTES} bytes; upload it as a file (the files API, MCP's upload_file) "
            "and run that file instead"
        )
    return code


def checked_command(command: object) -> str:
    """A shell command a caller sent, or a ConfigError that says what to send instead."""
    if not isinstance(command, str) or not command.strip():
        raise ConfigError("'command' must be a non-empty string: a /bin/sh command line")
    if len(command.encode()) > MAX_COMMAND_BYTES:
        raise ConfigError(f"the command is larger than {MAX_COMMAND_BYTES} bytes; upload a script and run it instead")
    return command


def client_door(value: object, default: str) -> str:
    """The ``source`` a client claimed for its execution, if it is one clients may claim."""
    if value is None:
        return default
    if value not in CLIENT_DOORS:
        raise ConfigError(f"'source' must be one of {', '.join(CLIENT_DOORS)} (or left out), not {value!r}")
    return str(value)


def execution_reply(result: ExecutionResult, budget: OutputBudget) -> dict[str, Any]:
    """A whole reply: the result with its outputs cut to the budget, and ``text``."""
    data = result.to_dict()
    data["outputs"], data["truncation"] = apply_budget(data["outputs"], budget)
    if result.chars_cut or result.outputs_dropped or result.bytes_omitted:
        data["truncation"]["truncated"] = True
    data["text"] = readable_text(data["outputs"])
    return data


class SessionService:
    """Runs code in a session and acts on its kernel, for every door (see the module docstring).

    ``budget`` is the gateway's output budget; ``metrics`` count the replies it cut (None where
    no metrics are kept)."""

    def __init__(self, budget: OutputBudget, metrics: GatewayMetrics | None = None) -> None:
        self.budget = budget
        self.metrics = metrics

    async def execute(
        self,
        managed: ManagedSession,
        door: str,
        code: object,
        timeout: object = None,
        *,
        tag: str | None = None,
        on_output: OutputCallback | None = None,
        on_result: Callable[[ExecutionResult], None] | None = None,
        shell: str | None = None,
    ) -> ExecutionResult:
        """Run ``code`` as one cell of ``managed``'s kernel, recorded as coming through ``door``.

        ``on_output`` hears each output as it comes (a streamed reply); ``on_result`` is handed
        the result before the observers record it (a door answers its client first). Refusals
        by a gate (policy, breaker, audit) are results, not errors: ``result.refusal`` says why."""
        checked = checked_code(code)
        seconds = None if timeout is None else check_timeout(timeout)
        managed.touch()
        return await managed.session.execute(
            checked, timeout=seconds, tag=tag, source=door, on_output=on_output, on_result=on_result, shell=shell
        )

    async def execute_relayed(
        self,
        managed: ManagedSession,
        door: str,
        code: object,
        send: Callable[[], str],
        reply: RelayedReply,
        silent: bool,
    ) -> ExecutionResult:
        """Run an execute_request a Jupyter client sent (the kernel websocket): the kernel gets
        the client's own message (``send``), the session still classifies, budgets and records
        it as any execute (kernels/execution/session.py ``execute_relayed``). Its size is the
        websocket's to bound (its message size and in-flight bytes: gateway/inflight.py), as
        Jupyter clients send cells of any size a notebook holds: not :data:`MAX_CODE_BYTES`."""
        if not isinstance(code, str):
            raise BadCodeError("execute_request content.code must be a string of source code")
        managed.touch()
        return await managed.session.execute_relayed(code, send, reply, silent=silent, source=door)

    async def shell(
        self, managed: ManagedSession, door: str, command: object, timeout: object = None, limit: object = None
    ) -> dict[str, Any]:
        """Run a shell command as a cell of ``managed``'s kernel (see :mod:`sandkernel.shell`).

        ``timeout`` (seconds; default the session's ``execute_timeout``) stops the command itself and
        reports exit code 124; the cell's own timeout is a little longer, as a backstop. ``limit``:
        the bytes of output brought back (head and tail; the default 64 KiB, at most 4 MiB).
        """
        command = checked_command(command)
        seconds = managed.session.profile.execute_timeout if timeout is None else check_timeout(timeout)
        result = await self.execute(
            managed,
            door,
            shell_code(command, seconds, output_limit(limit)),
            min(execution_timeout(seconds), MAX_EXECUTE_TIMEOUT),
            shell=command,
        )
        reply = {
            **shell_result(list(result.outputs), result.status.value).to_dict(),
            "duration": result.duration,
            "execution_count": result.execution_count,
            "ended_by": result.ended_by.value if result.ended_by else None,
            "state_lost": result.state_lost,
            "accounting": result.accounting,
            "policy": list(result.policy),
            "refusal": result.refusal,
        }
        if result.refusal is not None:  # nothing ran: the output is why, for the model to act on
            reply["output"] = str(result.refusal.get("message", ""))
        return reply

    def reply(self, result: ExecutionResult) -> dict[str, Any]:
        """The whole reply every door renders: outputs cut to the budget, counted when cut."""
        data = execution_reply(result, self.budget)
        self.count_truncated(data["truncation"])
        return data

    def count_truncated(self, truncation: dict[str, Any]) -> None:
        """Count a reply the budget cut (a streamed one reports its own truncation)."""
        if truncation.get("truncated") and self.metrics is not None:
            self.metrics.record_reply_truncated()

    async def list_files(self, managed: ManagedSession, path: str) -> list[dict[str, Any]]:
        """The entries of a /workspace directory (inside the sandbox: kernels/sandbox/workspace_files.py)."""
        managed.touch()
        return await managed.files.list(path)

    async def read_file(self, managed: ManagedSession, path: str) -> bytes:
        """A file's bytes, read inside the sandbox (refusals: WorkspaceFileError, with its code)."""
        managed.touch()
        return await managed.files.read(path)

    async def write_file(self, managed: ManagedSession, door: str, path: str, data: bytes) -> dict[str, Any]:
        """Write a tenant's file into /workspace, kept in the transcript too and audited."""
        managed.touch()
        return await managed.write_file(path, data, door=door)

    async def variables(self, managed: ManagedSession) -> list[dict[str, Any]]:
        """The kernel's user variables (a silent request the transcript notes)."""
        managed.touch()
        return await managed.session.variables()

    async def interrupt(self, managed: ManagedSession, door: str) -> bool:
        """Interrupt the running execution; False when a restart under way ends it instead."""
        managed.touch()
        return await managed.interrupt(door)

    async def restart(self, managed: ManagedSession, door: str) -> None:
        """Restart the kernel (variables gone, /workspace kept; a quarantine lifted)."""
        await managed.restart(door)
