"""The gateway's replies to an execution, shared by every door it serves itself (the session
API, its shell endpoint, its MCP server): one place that applies the output budget and reads a
shell cell back, so the doors cannot drift apart."""

from __future__ import annotations

from typing import Any

from sandkernel.doors import CLIENT_DOORS
from sandkernel.errors import ConfigError
from sandkernel.gateway.budget import OutputBudget, apply_budget
from sandkernel.gateway.managed import ManagedSession
from sandkernel.kernels.execution.outputs import ExecutionResult
from sandkernel.kernels.execution.session import MAX_EXECUTE_TIMEOUT, check_timeout
from sandkernel.output_text import readable_text
from sandkernel.shell import execution_timeout, output_limit, shell_code, shell_result

MAX_COMMAND_BYTES = 256 * 1024


def execution_reply(result: ExecutionResult, budget: OutputBudget) -> dict[str, Any]:
    """The session API's reply: the result with its outputs cut to the budget, and ``text``."""
    data = result.to_dict()
    data["outputs"], data["truncation"] = apply_budget(data["outputs"], budget)
    if result.chars_cut or result.outputs_dropped or result.bytes_omitted:
        data["truncation"]["truncated"] = True
    data["text"] = readable_text(data["outputs"])
    return data


def client_door(value: object, default: str) -> str:
    """The ``source`` a client claimed for its execution, if it is one clients may claim."""
    if value is None:
        return default
    if value not in CLIENT_DOORS:
        raise ConfigError(f"'source' must be one of {', '.join(CLIENT_DOORS)} (or left out), not {value!r}")
    return str(value)


def check_command(command: object) -> str:
    """A shell command a caller sent, or a ConfigError that says what to send instead."""
    if not isinstance(command, str) or not command.strip():
        raise ConfigError("'command' must be a non-empty string: a /bin/sh command line")
    if len(command.encode()) > MAX_COMMAND_BYTES:
        raise ConfigError(f"the command is larger than {MAX_COMMAND_BYTES} bytes; upload a script and run it instead")
    return command


async def run_shell(
    managed: ManagedSession, command: object, timeout: object, source: str, limit: object = None
) -> dict[str, Any]:
    """Run a shell command as a cell of ``managed``'s kernel (see :mod:`sandkernel.shell`).

    ``timeout`` (seconds; default the session's ``execute_timeout``) stops the command itself and
    reports exit code 124; the cell's own timeout is a little longer, as a backstop. ``limit``:
    the bytes of output brought back (head and tail; the default 64 KiB, at most 4 MiB).
    """
    command = check_command(command)
    seconds = managed.session.profile.execute_timeout if timeout is None else check_timeout(timeout)
    result = await managed.session.execute(
        shell_code(command, seconds, output_limit(limit)),
        timeout=min(execution_timeout(seconds), MAX_EXECUTE_TIMEOUT),
        source=source,
        shell=command,
    )
    shell = shell_result(list(result.outputs), result.status.value)
    reply = {
        **shell.to_dict(),
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
