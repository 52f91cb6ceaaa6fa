"""Shell commands as kernel cells: how a command runs in the sandbox and how its result reads back.

A shell command (MCP's ``run_shell``, deepagents' ``execute``, ``POST .../shell``) runs as a
Python cell of the session's kernel, not as a side channel: it is recorded in the transcript,
queued behind the other doors' executions, bounded by the same limits and replayed with the
notebook. The cell runs ``/bin/sh -c`` in its own process group (killed whole at the timeout),
spools the merged stdout/stderr to an unlinked temporary file (so a flood costs disk under the
sandbox's own limits, never kernel memory), prints a head and a tail of it, and displays the exit
code as a small JSON bundle. The bundle comes from the sandbox and is parsed as hostile data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sandkernel.errors import ConfigError

SHELL_MIME = "application/vnd.sandkernel.shell+json"
# What a command's output brings back by default: its first and last halves, the middle cut.
MAX_SHELL_OUTPUT_BYTES = 64 * 1024
# The most a caller may ask for (``output_limit``): a tool that pages files through commands, as
# deepagents' read does with pages of up to 500 KiB sent as JSON, needs a page back whole.
MAX_SHELL_OUTPUT_LIMIT = 4 * 1024 * 1024
TIMED_OUT_EXIT_CODE = 124  # what coreutils' timeout(1) reports, so tools read it the usual way
# The execution is allowed this much longer than the command, so the command's own timeout (which
# reports the exit code and the output so far) fires before the session's timeout ladder does.
EXECUTION_MARGIN = 15.0

# The cell: a function defined, called and deleted, so it leaves nothing in the user's namespace.
_CELL = """\
# $ {headline}
def _sandkernel_shell(command, timeout, limit):
    import os, signal, subprocess, sys, tempfile
    from IPython.display import display
    with tempfile.TemporaryFile() as spool:
        child = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL, stdout=spool,
                                 stderr=subprocess.STDOUT, cwd="/workspace", start_new_session=True)
        try:
            code, timed_out = child.wait(timeout=timeout), False
        except BaseException as stop:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            if not isinstance(stop, subprocess.TimeoutExpired):
                raise
            code, timed_out = {timed_out_code}, True
        size = spool.seek(0, os.SEEK_END)
        spool.seek(0)
        if size <= limit:
            text = spool.read().decode(errors="replace")
        else:
            head = spool.read(limit // 2).decode(errors="replace")
            spool.seek(size - limit // 2)
            tail = spool.read().decode(errors="replace")
            text = head + "\\n[... %d bytes cut ...]\\n" % (size - limit // 2 * 2) + tail
    sys.stdout.write(text)
    sys.stdout.flush()
    result = {{"exit_code": code, "timed_out": timed_out, "bytes": size, "truncated": size > limit}}
    display({{{mime!r}: result}}, raw=True)
try:
    _sandkernel_shell({command!r}, {timeout!r}, {limit!r})
finally:
    del _sandkernel_shell
"""


def shell_code(command: str, timeout: float, limit: int = MAX_SHELL_OUTPUT_BYTES) -> str:
    """The Python cell that runs ``command`` in /workspace with ``/bin/sh -c``; its first line names
    the command so a transcript reads as a shell session."""
    first = (command.strip().splitlines() or [""])[0][:200]
    headline = "".join(char if char.isprintable() else "?" for char in first)
    return _CELL.format(
        headline=headline,
        command=command,
        timeout=float(timeout),
        limit=int(limit),
        mime=SHELL_MIME,
        timed_out_code=TIMED_OUT_EXIT_CODE,
    )


def output_limit(value: object) -> int:
    """The output limit a caller asked for (None: :data:`MAX_SHELL_OUTPUT_BYTES`), or a
    ConfigError (400) saying what it may be."""
    if value is None:
        return MAX_SHELL_OUTPUT_BYTES
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= MAX_SHELL_OUTPUT_LIMIT:
        raise ConfigError(
            f"'output_limit' is a number of bytes from 1024 to {MAX_SHELL_OUTPUT_LIMIT} (default "
            f"{MAX_SHELL_OUTPUT_BYTES}), not {value!r}"
        )
    return value


def execution_timeout(timeout: float) -> float:
    """The session timeout for a shell cell whose command may run ``timeout`` seconds."""
    return float(timeout) + EXECUTION_MARGIN


@dataclasses.dataclass(frozen=True)
class ShellResult:
    """What a shell command left: its output (stdout and stderr merged, head and tail when long),
    its exit code (None when the cell never reported one: the kernel died, the session timed out,
    the code was interrupted), whether its own timeout stopped it, whether output was cut, and
    the cell's execution status (``ok`` unless the cell itself was stopped)."""

    output: str
    exit_code: int | None
    timed_out: bool = False
    truncated: bool = False
    status: str = "ok"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def shell_result(outputs: list[dict[str, Any]], status: str = "ok") -> ShellResult:
    """Read a shell cell's nbformat outputs back (stream text, the exit-code bundle, any error)."""
    text: list[str] = []
    report: dict[str, Any] = {}
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            text.append(_text(output.get("text")))
        elif kind in ("display_data", "execute_result"):
            bundle = (output.get("data") or {}).get(SHELL_MIME)
            if isinstance(bundle, dict):
                report = bundle
        elif kind == "error":
            text.append(f"{output.get('ename', 'Error')}: {output.get('evalue', '')}\n")
    code = report.get("exit_code")
    return ShellResult(
        output="".join(text),
        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
        timed_out=report.get("timed_out") is True,
        truncated=report.get("truncated") is True,
        status=status,
    )


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(part) for part in value)
    return value if isinstance(value, str) else ""
