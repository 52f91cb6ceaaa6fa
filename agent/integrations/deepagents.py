"""A sandkernel session as a deepagents sandbox: ``create_deep_agent(..., backend=SandkernelSandbox(session))``.

    from sandkernel.agent import Sandkernel
    from sandkernel.integrations.deepagents import SandkernelSandbox

    with Sandkernel() as sk, sk.session() as session:
        sandbox = SandkernelSandbox(session)
        agent = create_deep_agent(model=..., backend=sandbox, tools=[sandbox.run_python_tool()])

What deepagents 0.7's sandbox protocol (:class:`deepagents.backends.sandbox.BaseSandbox`) asks of a
provider, and how sandkernel answers it:

- ``execute(command, timeout=...)`` runs a ``/bin/sh`` command through the session's shell door
  (``session.shell``, recorded with source ``"deepagents"``): a cell of the session's kernel, so it
  is in the transcript, queued behind the session's other executions, and replayed with it. A
  command stopped by its timeout reports exit code 124 (as ``timeout(1)`` does) with the output so
  far; the session stays usable. ``timeout=None`` is the sandbox's default (the session profile's
  execute_timeout, unless the sandbox was given its own); ``0`` is not "no limit" here (nothing in
  sandkernel is unbounded) but the longest deepagents itself allows.
  Its output comes back whole up to :data:`OUTPUT_LIMIT` (2 MiB; BaseSandbox's file tools page
  files through commands in pieces of up to 500 KiB), head and tail beyond that, flagged
  ``truncated``.
- ``upload_files`` / ``download_files`` go through the session's files API, byte for byte (up to
  the gateway's 32 MiB per file): an absolute path anywhere the sandbox's user may read or write
  (/workspace, /tmp, a new directory: parents are made), resolved and opened inside the sandbox
  as that user, never by the host. Each upload is recorded in the transcript, so a replay puts it
  back before the cell that followed it (deepagents' ``edit`` sends a large edit's texts as /tmp
  files). A relative path is refused with ``invalid_path``, as the protocol says: where it would
  land is not defined. Refusals are values (``file_not_found``, ``is_directory``,
  ``invalid_path``, ``permission_denied``, or sandkernel's own code such as ``too_large``), never
  exceptions; a gateway that cannot be reached or a session that is gone raise the client's
  exception, as ``execute`` does.
- ``ls``, ``read``, ``write``, ``edit``, ``grep``, ``glob`` and ``delete`` are BaseSandbox's, built
  on ``execute`` (short ``python3``/``grep`` commands, which the kernel image has).

Sync and async: the session may be a blocking :class:`sandkernel.agent.Session` or an
:class:`sandkernel.agent.AsyncSession`. The ``a*`` methods never block the event loop: on an
AsyncSession they await it directly, on a Session they run it in a worker thread. The blocking
methods on an AsyncSession (deepagents calls some from a worker thread, e.g. ``adelete``) hand the
call to the event loop the session was last used on; called on that loop itself they raise, since
they could only deadlock it.

:meth:`SandkernelSandbox.run_python_tool` is the other half of sandkernel's offer: a LangChain tool
that runs Python in the same session's kernel, state kept between calls, with text, the traceback
of an error, and displayed figures as images (recorded with source ``"deepagents"`` too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Generator
from contextvars import ContextVar
from typing import Any, TypeVar

try:
    from deepagents.backends.protocol import (
        FILE_NOT_FOUND,
        INVALID_PATH,
        IS_DIRECTORY,
        PERMISSION_DENIED,
        ExecuteResponse,
        FileDownloadResponse,
        FileUploadResponse,
        GrepResult,
        ReadResult,
    )
    from deepagents.backends.sandbox import BaseSandbox
    from langchain_core.tools import BaseTool, StructuredTool, ToolException
except ImportError as missing:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"sandkernel.integrations.deepagents needs deepagents and langchain ({missing.name} is not installed): "
        "pip install 'sandkernel[deepagents]'"
    ) from missing

from sandkernel.agent.client import AsyncSession
from sandkernel.agent.errors import ClientError
from sandkernel.agent.execution import Execution
from sandkernel.agent.sync_client import Session
from sandkernel.agent.tools import TOOLS, result_block
from sandkernel.doors import DEEPAGENTS
from sandkernel.shell import ShellResult

__all__ = ["SandkernelSandbox", "run_python_tool"]

T = TypeVar("T")

# The output a command brings back whole: a page of BaseSandbox's read (up to 500 KiB of text, or
# a binary file up to 500 KiB) travels as one JSON document, which escapes make larger.
OUTPUT_LIMIT = 2 * 1024 * 1024
# What ``timeout=0`` means here: deepagents' own ceiling for one command (FilesystemMiddleware's
# max_execute_timeout default), since sandkernel runs nothing without a bound.
LONGEST_TIMEOUT = 3600.0
DEFAULT_PYTHON_TIMEOUT = 120.0
# The files API's refusals (kernels/sandbox/workspace_files.py codes) in the protocol's words; a
# file that is not a regular one (a symlink, a FIFO, a device) is not read or replaced: denied.
PROTOCOL_ERRORS = {
    "not_found": FILE_NOT_FOUND,
    "not_a_directory": FILE_NOT_FOUND,
    "bad_path": INVALID_PATH,
    "is_directory": IS_DIRECTORY,
    "permission_denied": PERMISSION_DENIED,
    "not_regular": PERMISSION_DENIED,
}
# Codes of a refused file request: a value in the response. Any other ClientError is the gateway
# or the session failing, which raises.
FILE_CODES = {*PROTOCOL_ERRORS, "too_large", "no_space", "not_written"}


def sandbox_path(path: object) -> str | None:
    """``path`` if it is one the protocol lets through (absolute, no NUL); None: invalid_path."""
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path:
        return None
    return path


class _Bridge:
    """Calls one client session's methods from sync and async code without blocking an event loop."""

    def __init__(self, session: Session | AsyncSession) -> None:
        if not isinstance(session, (Session, AsyncSession)):
            raise TypeError(
                f"SandkernelSandbox needs a sandkernel.agent Session or AsyncSession, not {type(session).__name__}"
            )
        self.session = session
        self.is_async = isinstance(session, AsyncSession)
        self.loop: asyncio.AbstractEventLoop | None = None  # where an AsyncSession was last used
        with contextlib.suppress(RuntimeError):
            self.loop = asyncio.get_running_loop()

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``session.<name>(...)`` from blocking code."""
        method = getattr(self.session, name)
        if not self.is_async:
            return method(*args, **kwargs)
        return self._block_on(method(*args, **kwargs), name)

    async def acall(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``session.<name>(...)`` from async code: awaited on an AsyncSession, in a thread on a Session."""
        method = getattr(self.session, name)
        if not self.is_async:
            return await asyncio.to_thread(method, *args, **kwargs)
        self.loop = asyncio.get_running_loop()
        return await method(*args, **kwargs)

    def _block_on(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = self.loop
        if running is not None or loop is None or loop.is_closed() or not loop.is_running():
            coro.close()
            where = "on the event loop" if running is not None else "with no event loop running the session"
            raise RuntimeError(
                f"SandkernelSandbox: the blocking {name}() was called {where}; with an AsyncSession use the "
                "async API (await agent.ainvoke(...)), or give SandkernelSandbox a blocking sandkernel.agent.Session"
            )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()


class SandkernelSandbox(BaseSandbox):
    """deepagents' sandbox protocol over one sandkernel session (see the module docstring).

    ``session`` is a :class:`sandkernel.agent.Session` or :class:`sandkernel.agent.AsyncSession`;
    the caller owns it (deleting it is theirs). ``timeout`` is the default for ``execute`` in
    seconds (None: the session profile's execute_timeout). ``id`` is the session's id.
    """

    def __init__(self, session: Session | AsyncSession, *, timeout: float | None = None) -> None:
        self._bridge = _Bridge(session)
        self.session = session
        self.default_timeout = timeout

    @property
    def id(self) -> str:
        return self.session.id

    def __repr__(self) -> str:
        return f"<SandkernelSandbox {self.session.id}>"

    # -- execute ---------------------------------------------------------------------------

    def _seconds(self, timeout: int | float | None) -> float | None:
        if timeout is None:
            return self.default_timeout
        if timeout < 0:
            raise ValueError(f"timeout must be 0 or more seconds, not {timeout}")
        return LONGEST_TIMEOUT if timeout == 0 else float(timeout)

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        """Run ``command`` with ``/bin/sh -c`` in /workspace; stdout and stderr merged."""
        seconds = self._seconds(timeout)
        result = self._bridge.call("shell", command, timeout=seconds, source=DEEPAGENTS, output_limit=OUTPUT_LIMIT)
        return _response(result, seconds)

    async def aexecute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        seconds = self._seconds(timeout)
        result = await self._bridge.acall(
            "shell", command, timeout=seconds, source=DEEPAGENTS, output_limit=OUTPUT_LIMIT
        )
        return _response(result, seconds)

    # -- file tools whose output can outgrow the shell's --------------------------------------
    # A command brings back at most OUTPUT_LIMIT (head and tail, the middle cut), while
    # BaseSandbox's read sends a page of up to 500 KiB as one JSON document, which escapes can
    # make larger still: a cut page would not parse. So a page that came back cut is asked for
    # again with half the lines (each read says where the next one starts), and a cut grep is
    # flagged as incomplete.

    def read(self, file_path: str, offset: int = 0, limit: int = 2000) -> ReadResult:
        while True:
            watch = _watch()
            result = super().read(file_path, offset, limit)
            if not watch.cut or limit <= 1:
                return _whole_page(result, file_path, watch)
            limit //= 2

    async def aread(self, file_path: str, offset: int = 0, limit: int = 2000) -> ReadResult:
        while True:
            watch = _watch()
            result = await super().aread(file_path, offset, limit)
            if not watch.cut or limit <= 1:
                return _whole_page(result, file_path, watch)
            limit //= 2

    def grep(
        self, pattern: str, path: str | None = None, glob: str | None = None, *, max_count: int | None = None
    ) -> GrepResult:
        watch = _watch()
        return _flag_cut(super().grep(pattern, path, glob, max_count=max_count), watch)

    async def agrep(
        self, pattern: str, path: str | None = None, glob: str | None = None, *, max_count: int | None = None
    ) -> GrepResult:
        watch = _watch()
        return _flag_cut(await super().agrep(pattern, path, glob, max_count=max_count), watch)

    # -- files -----------------------------------------------------------------------------

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Write each file at its absolute path (parents made); one response per file, in order."""
        return [_drive(_upload_steps(path, data), self._bridge.call) for path, data in files]

    async def aupload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        return [await _adrive(_upload_steps(path, data), self._bridge.acall) for path, data in files]

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Read each file at its absolute path, bytes exactly; one response per path, in order."""
        return [_drive(_download_steps(path), self._bridge.call) for path in paths]

    async def adownload_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        return [await _adrive(_download_steps(path), self._bridge.acall) for path in paths]

    # -- run_python ------------------------------------------------------------------------

    def run_python_tool(self, *, timeout: float = DEFAULT_PYTHON_TIMEOUT) -> BaseTool:
        """A ``run_python`` LangChain tool over this sandbox's session (see :func:`run_python_tool`)."""
        return run_python_tool(self.session, timeout=timeout, _bridge=self._bridge)


class _Watch:
    """Whether a command run for one file-tool call came back cut (set by :func:`_response`)."""

    cut = False


# The watch of the file-tool call under way, in a context variable so concurrent tool calls and
# threads each see their own; it holds an object, not a flag, because BaseSandbox runs some
# commands in a task of their own (asyncio.wait_for), which sees a copy of the context.
_WATCH: ContextVar[_Watch | None] = ContextVar("sandkernel_file_tool_watch", default=None)


def _watch() -> _Watch:
    watch = _Watch()
    _WATCH.set(watch)
    return watch


def _whole_page(result: ReadResult, file_path: str, watch: _Watch) -> ReadResult:
    if not watch.cut:
        return result
    return ReadResult(
        error=f"File '{file_path}': one line at this offset is longer than the sandbox's shell output limit "
        f"({OUTPUT_LIMIT // 1024} KiB); read it with execute (e.g. cut -c or head -c)"
    )


def _flag_cut(result: GrepResult, watch: _Watch) -> GrepResult:
    if not watch.cut or result.matches is None:
        return result
    return GrepResult(error=result.error, matches=result.matches, truncated=True)


def _response(result: ShellResult, seconds: float | None) -> ExecuteResponse:
    watch = _WATCH.get()
    if watch is not None and result.truncated:
        watch.cut = True
    output = result.output
    if result.timed_out:  # said in words too: an exit code of 124 alone reads like the command's own
        limit = f" of {seconds:g} s" if seconds is not None else ""
        output += f"\n[sandkernel: the command was stopped at its timeout{limit}]"
    elif result.exit_code is None:
        output += "\n[sandkernel: the command did not report an exit code (its kernel cell did not finish)]"
    return ExecuteResponse(output=output, exit_code=result.exit_code, truncated=result.truncated)


# A file transfer is written once, as a generator of session calls: each ``yield`` is a call
# ``(method, args, kwargs)`` that :func:`_drive` (blocking) or :func:`_adrive` (awaited) performs, sending
# back its value or throwing its ClientError in. So the sync and async methods share one body.
Steps = Generator[tuple[Any, ...], Any, T]


def _upload_steps(path: str, data: bytes) -> Steps[FileUploadResponse]:
    target = sandbox_path(path)
    if target is None:
        return FileUploadResponse(path=path, error=INVALID_PATH)
    try:
        yield ("upload", (target, bytes(data)), {})
    except ClientError as refused:
        return FileUploadResponse(path=path, error=_refusal(refused))
    return FileUploadResponse(path=path, error=None)


def _download_steps(path: str) -> Steps[FileDownloadResponse]:
    target = sandbox_path(path)
    if target is None:
        return FileDownloadResponse(path=path, content=None, error=INVALID_PATH)
    try:
        content = yield ("download", (target,), {})
    except ClientError as refused:
        return FileDownloadResponse(path=path, content=None, error=_refusal(refused))
    return FileDownloadResponse(path=path, content=bytes(content), error=None)


def _refusal(refused: ClientError) -> str:
    """The protocol's error value for a refused file request; re-raises what is not about the file."""
    if refused.code not in FILE_CODES:
        raise refused
    return PROTOCOL_ERRORS.get(refused.code, refused.code)


def _drive(steps: Steps[T], call: Callable[..., Any]) -> T:
    """Run a transfer's steps with blocking session calls."""
    try:
        step = next(steps)
        while True:
            try:
                name, args, kwargs = step
                value = call(name, *args, **kwargs)
            except ClientError as err:
                step = steps.throw(err)
            else:
                step = steps.send(value)
    except StopIteration as done:
        return done.value


async def _adrive(steps: Steps[T], call: Callable[..., Awaitable[Any]]) -> T:
    """Run a transfer's steps with awaited session calls."""
    try:
        step = next(steps)
        while True:
            try:
                name, args, kwargs = step
                value = await call(name, *args, **kwargs)
            except ClientError as err:
                step = steps.throw(err)
            else:
                step = steps.send(value)
    except StopIteration as done:
        return done.value


# -- run_python ------------------------------------------------------------------------------

RUN_PYTHON = next(tool for tool in TOOLS if tool["name"] == "run_python")


def run_python_tool(
    session: Session | AsyncSession, *, timeout: float = DEFAULT_PYTHON_TIMEOUT, _bridge: _Bridge | None = None
) -> BaseTool:
    """A LangChain tool ``run_python(code, timeout=None)`` that runs Python in ``session``'s kernel.

    State persists between calls, and the files are the sandbox's (both work in /workspace). The
    result is the agent loop's own (:func:`sandkernel.agent.tools.result_block`): text, then up to
    four displayed images as image blocks; an exception or a timeout comes back as a tool error
    (the ToolMessage's status ``"error"``, the API's ``is_error``) carrying the traceback. Each call
    is a transcript cell with source ``"deepagents"``. ``timeout`` is the default per call, in seconds.
    """
    bridge = _bridge or _Bridge(session)
    default_timeout = timeout

    def checked(code: str, seconds: float | None) -> tuple[str, float]:
        if not isinstance(code, str) or not code.strip():
            raise ToolException("run_python needs non-empty 'code'")
        return code, float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else default_timeout

    def run(code: str, timeout: float | None = None) -> list[dict[str, Any]]:
        code, seconds = checked(code, timeout)
        return _tool_content(bridge.call("run", code, timeout=seconds, source=DEEPAGENTS))

    async def arun(code: str, timeout: float | None = None) -> list[dict[str, Any]]:
        code, seconds = checked(code, timeout)
        return _tool_content(await bridge.acall("run", code, timeout=seconds, source=DEEPAGENTS))

    return StructuredTool.from_function(
        func=run,
        coroutine=arun,
        name="run_python",
        description=RUN_PYTHON["description"],
        args_schema=RUN_PYTHON["input_schema"],
        handle_tool_error=lambda error: error.args[0] if error.args else "run_python failed",
    )


def _tool_content(execution: Execution) -> list[dict[str, Any]]:
    """The tool's content blocks; a failed execution raises them as a ToolException (status error)."""
    block = result_block("", execution)
    content = block["content"] if isinstance(block["content"], list) else [{"type": "text", "text": block["content"]}]
    if block["is_error"]:
        raise ToolException(content)
    return content
