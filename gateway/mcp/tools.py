"""The MCP server: sandkernel's sessions as tools a model calls, and each session's notebook.

Built on the official SDK's high-level server (``mcp.server.mcpserver.MCPServer``): tool schemas
come from the signatures below, and each tool returns a ``CallToolResult`` of its own, because
what a model needs is more than a string: the text of a run, its images as MCP image content,
``isError`` when the code failed (with the traceback in the text), and ``structuredContent``
(status, execution count, duration, truncation) for a client that reads fields.

The tools never decide whose session they touch: each call asks the transport's
:data:`~sandkernel.gateway.mcp.resolver.ResolverFor` for the caller's resolver (resolver.py).
Executions are recorded in the session's transcript with ``source: "mcp"``, budgeted like the
session API's replies (gateway/budget.py through gateway/replies.py). A bad argument or a refusal
(unknown session, path outside /workspace, a limit) comes back as a tool error that says what to
fix; nothing a caller sends can crash the server (the SDK turns any other exception into a
generic tool error and logs it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import mimetypes
import re
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp_types import (
    BlobResourceContents,
    CallToolResult,
    ContentBlock,
    EmbeddedResource,
    ImageContent,
    TextContent,
    ToolAnnotations,
)
from pydantic import Field

from sandkernel import __version__
from sandkernel.doors import MCP
from sandkernel.errors import ConfigError, KernelNotFoundError, SandkernelError
from sandkernel.gateway.budget import OutputBudget
from sandkernel.gateway.mcp.resolver import ResolverFor, SessionResolver
from sandkernel.gateway.registry import ManagedSession
from sandkernel.gateway.replies import execution_reply, run_shell
from sandkernel.gateway.sessions_api import MAX_CODE_BYTES
from sandkernel.images import fit_image
from sandkernel.kernels.sandbox.workspace_files import MAX_FILE_BYTES, WorkspaceFiles
from sandkernel.mime import IMAGE_MIME_TYPES, is_api_image
from sandkernel.truncation import clip_text, cut_marker

SOURCE = MCP  # the door, in the transcript's cell metadata (only this server sets it)
NOTEBOOK_URI = "sandkernel://sessions/{session_id}/notebook"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

INSTRUCTIONS = """\
sandkernel runs your Python in a sandboxed, stateful Jupyter kernel (a locked-down container).
State persists: variables, imports and files in /workspace stay between calls, like cells of one
notebook. Every result names the session it ran in (session_id): pass that session_id on your
next calls to keep working in the same state (without one, a connection that keeps no MCP session
starts a new sandbox each time). Start more with create_session to keep separate states. Figures you
display (matplotlib, PIL) come back as images. Every call is recorded in the session's notebook
(resource sandkernel://sessions/{session_id}/notebook)."""

SessionId = Annotated[
    str | None,
    Field(
        description="The session to act on, as named by an earlier result or create_session; "
        "omit it on your first call to start one."
    ),
]


# -- images -------------------------------------------------------------------------------------


async def _fitted(data: bytes, mime: str) -> tuple[bytes, str] | str:
    """:func:`fit_image` in a worker thread: decoding and resizing a large image would hold up
    the gateway's event loop (every other session's traffic) for its whole duration."""
    return await asyncio.to_thread(fit_image, data, mime)


def _image_content(fitted: tuple[bytes, str]) -> ImageContent:
    data, mime = fitted
    return ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=mime)


async def _image_blocks(outputs: list[dict[str, Any]]) -> list[ContentBlock]:
    """One image block per displayed image (the bundle's preferred image type), in order."""
    blocks: list[ContentBlock] = []
    for output in outputs:
        data = output.get("data")
        if output.get("output_type") not in ("display_data", "execute_result") or not isinstance(data, dict):
            continue
        mime = next((m for m in IMAGE_MIME_TYPES if is_api_image(m) and isinstance(data.get(m), str)), None)
        if mime is None:
            continue  # SVG only, or no image: its text/plain is in the text already
        try:
            raw = base64.b64decode(data[mime])
        except (binascii.Error, ValueError):
            blocks.append(TextContent(type="text", text=f"[{mime} image not shown: its data is not base64]"))
            continue
        fitted = await _fitted(raw, mime)
        blocks.append(TextContent(type="text", text=fitted) if isinstance(fitted, str) else _image_content(fitted))
    return blocks


# -- results ------------------------------------------------------------------------------------


def _result(
    text: str, structured: dict[str, Any], is_error: bool = False, extra: list[ContentBlock] | None = None
) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text), *(extra or [])], structured_content=structured, is_error=is_error
    )


def _execution_text(reply: dict[str, Any]) -> str:
    """What the model reads of one run: its output, the traceback, how it ended if not normally."""
    text = ANSI.sub("", reply.get("text") or "")
    error = reply.get("error")
    if error:
        text += "\n" + ANSI.sub("", "\n".join(error.get("traceback") or [f"{error['name']}: {error['value']}"]))
    status = reply["status"]
    if status not in ("ok", "error"):
        text += f"\n[sandkernel: the execution ended as {status}"
        text += f" ({reply['ended_by']})" if reply.get("ended_by") else ""
        text += f"; {reply['state_lost']}]" if reply.get("state_lost") else "]"
    if reply["truncation"].get("truncated"):
        text += cut_marker(None, what="output", why="over the reply's budget; the session notebook has all of it")
    for finding in reply.get("policy") or ():
        if finding.get("action") == "warn":  # the code ran; the model should still hear it
            text += f"\n[sandkernel policy warning ({finding.get('rule')}): {finding.get('message')}]"
    return text.strip() or "(no output)"


def _tool_error(err: SandkernelError) -> ToolError:
    """A refusal as the tool error a model reads and can act on."""
    message = str(err)
    if isinstance(err, KernelNotFoundError) and "session" in message:
        message += "; call list_sessions to see your sessions, or omit session_id to use your default session"
    return ToolError(message)


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise ToolError("timeout must be a positive number of seconds (or omitted for the default)")
    return timeout


class McpTools:
    """The tools and the notebook resource of one MCP server; every call resolves its caller."""

    def __init__(self, resolver_for: ResolverFor, budget: OutputBudget) -> None:
        self.resolver_for = resolver_for
        self.budget = budget

    def resolver(self, ctx: Context) -> SessionResolver:
        try:
            return self.resolver_for(ctx.request_context)
        except SandkernelError as err:
            raise _tool_error(err) from err

    async def managed(self, ctx: Context, session_id: str | None) -> ManagedSession:
        if session_id is not None and (not session_id or len(session_id) > 200):
            raise ToolError("session_id must be a session id from create_session or list_sessions")
        try:
            return await self.resolver(ctx).session_for(session_id)
        except SandkernelError as err:
            raise _tool_error(err) from err

    # -- running code -----------------------------------------------------------------------

    async def run_python(
        self,
        ctx: Context,
        code: Annotated[str, Field(description="Python source to run, like one notebook cell.")],
        session_id: SessionId = None,
        timeout: Annotated[float | None, Field(description="Seconds before the run is stopped.")] = None,
    ) -> CallToolResult:
        """Run Python code in your sandboxed, stateful kernel and return its output.

        State persists between calls (variables, imports, files in /workspace), so build on
        earlier results instead of recomputing them. The value of the last expression is shown,
        as in a notebook. Figures and images you display come back as images. An exception comes
        back as an error result with the traceback. For shell commands use run_shell."""
        if len(code.encode()) > MAX_CODE_BYTES:
            raise ToolError(f"code is larger than {MAX_CODE_BYTES} bytes; upload it with upload_file and run it")
        managed = await self.managed(ctx, session_id)
        managed.touch()
        try:
            result = await managed.session.execute(code, timeout=_check_timeout(timeout), source=SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        reply = execution_reply(result, self.budget)
        structured = {
            "session_id": managed.id,
            "status": reply["status"],
            "execution_count": reply["execution_count"],
            "duration": reply["duration"],
            "truncation": reply["truncation"],
            "error": {"name": reply["error"]["name"], "value": reply["error"]["value"]} if reply["error"] else None,
            "policy": reply["policy"],
            "refusal": reply["refusal"],
            "accounting": reply["accounting"],
        }
        images = await _image_blocks(reply["outputs"])
        return _result(_execution_text(reply), structured, reply["status"] != "ok", images)

    async def run_shell(
        self,
        ctx: Context,
        command: Annotated[str, Field(description="A /bin/sh command line, run in /workspace.")],
        session_id: SessionId = None,
        timeout: Annotated[float | None, Field(description="Seconds before the command is killed.")] = None,
    ) -> CallToolResult:
        """Run a shell command in the sandbox (in /workspace, stdout and stderr merged).

        Runs in the same session as run_python, so files one writes the other sees. A non-zero
        exit code comes back as an error result that names it; a command over its timeout is
        killed (exit code 124). Use it for pip installs, git, ls, or any command-line tool."""
        managed = await self.managed(ctx, session_id)
        managed.touch()
        try:
            reply = await run_shell(managed, command, _check_timeout(timeout), SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        text = ANSI.sub("", reply.get("output") or "").rstrip()
        if reply.get("timed_out"):
            text += "\n[sandkernel: the command timed out and was killed]"
        elif reply["status"] != "ok":
            text += f"\n[sandkernel: the command's execution ended as {reply['status']}]"
        text += f"\n[exit code {reply.get('exit_code')}]"
        failed = reply["status"] != "ok" or reply.get("exit_code") != 0
        return _result(text.strip(), {"session_id": managed.id, **reply}, failed)

    # -- files --------------------------------------------------------------------------------

    async def upload_file(
        self,
        ctx: Context,
        path: Annotated[str, Field(description="Where to write it, relative to /workspace, e.g. 'data/sales.csv'.")],
        content: Annotated[str, Field(description="The file's content: text, or base64 for binary files.")],
        encoding: Annotated[str, Field(description="'text' (UTF-8) or 'base64'.")] = "text",
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Write a file into the sandbox's /workspace (replacing it if it exists), for your code
        to read. Text is written as UTF-8; send binary files base64-encoded with encoding 'base64'."""
        if encoding == "text":
            data = content.encode()
        elif encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError) as err:
                raise ToolError(f"content is not valid base64 ({err}); send text with encoding 'text'") from err
        else:
            raise ToolError("encoding must be 'text' or 'base64'")
        if len(data) > MAX_FILE_BYTES:
            raise ToolError(f"the file is {len(data)} bytes; the limit is {MAX_FILE_BYTES}")
        managed = await self.managed(ctx, session_id)
        try:
            written = await managed.write_file(path, data, door=SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        managed.touch()
        where = written.get("path", path)
        return _result(f"wrote {len(data)} bytes to /workspace/{where}", {"session_id": managed.id, **written})

    async def download_file(
        self,
        ctx: Context,
        path: Annotated[str, Field(description="The file, relative to /workspace.")],
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Read a file from the sandbox's /workspace. Text files come back as text (long ones cut
        in the middle), images as images, other binary files as an embedded base64 resource.
        For large data, summarise it with run_python instead of reading it whole."""
        managed = await self.managed(ctx, session_id)
        try:
            data = await WorkspaceFiles(managed.session.container).read(path)
        except SandkernelError as err:
            raise _tool_error(err) from err
        managed.touch()
        mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
        info: dict[str, Any] = {"session_id": managed.id, "path": path, "size": len(data), "mime_type": mime}
        if is_api_image(mime):
            fitted = await _fitted(data, mime)
            if not isinstance(fitted, str):
                image = _image_content(fitted)
                return _result(f"{path}: {len(data)} bytes, {mime}", {**info, "encoding": "image"}, extra=[image])
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = None
        if text is not None and "\x00" not in text:
            clipped = clip_text(text, self.budget.max_text_bytes, why="over the reply's text budget")
            return _result(clipped.text, {**info, "encoding": "text", "truncated": clipped.truncated})
        if len(data) > self.budget.max_image_bytes:
            raise ToolError(
                f"{path} is {len(data)} bytes of binary data, over the {self.budget.max_image_bytes} bytes a reply "
                "may carry; inspect it with run_python instead"
            )
        blob = BlobResourceContents(
            uri=f"sandkernel://sessions/{managed.id}/files/{path.lstrip('/')}",
            mime_type=mime,
            blob=base64.b64encode(data).decode(),
        )
        resource = EmbeddedResource(type="resource", resource=blob)
        return _result(f"{path}: {len(data)} bytes, {mime} (binary)", {**info, "encoding": "base64"}, extra=[resource])

    async def list_files(
        self,
        ctx: Context,
        path: Annotated[str, Field(description="A directory relative to /workspace; '' is /workspace.")] = "",
        session_id: SessionId = None,
    ) -> CallToolResult:
        """List a directory of the sandbox's /workspace: names, types and sizes."""
        managed = await self.managed(ctx, session_id)
        try:
            entries = await WorkspaceFiles(managed.session.container).list(path)
        except SandkernelError as err:
            raise _tool_error(err) from err
        lines = [
            f"{e['name']}/" if e["type"] == "directory" else f"{e['name']}  ({e['type']}, {e['size']} bytes)"
            for e in entries
        ]
        text = clip_text("\n".join(lines) or "(empty directory)", self.budget.max_text_bytes).text
        return _result(text, {"session_id": managed.id, "path": path, "entries": entries})

    # -- the kernel ---------------------------------------------------------------------------

    async def list_variables(self, ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """List the variables in the kernel's namespace (name, type, size, shape), without
        running code and without printing their values."""
        managed = await self.managed(ctx, session_id)
        try:
            variables = await managed.session.variables()
        except SandkernelError as err:
            raise _tool_error(err) from err
        lines = [", ".join(f"{k}={v}" for k, v in var.items() if v is not None) for var in variables]
        text = clip_text("\n".join(lines) or "(no variables)", self.budget.max_text_bytes).text
        return _result(text, {"session_id": managed.id, "variables": variables})

    async def interrupt(self, ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """Interrupt the code running in the session (KeyboardInterrupt); variables are kept."""
        managed = await self.managed(ctx, session_id)
        try:
            await managed.interrupt(SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        return _result("interrupted", {"session_id": managed.id})

    async def restart(self, ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """Restart the session's kernel: all variables and imports are lost, files in /workspace
        are kept. Use it when the kernel is stuck or its state is broken."""
        managed = await self.managed(ctx, session_id)
        try:
            await managed.restart(SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        return _result("restarted: variables cleared, /workspace kept", {"session_id": managed.id})

    # -- sessions -----------------------------------------------------------------------------

    async def create_session(
        self,
        ctx: Context,
        profile: Annotated[str | None, Field(description="A profile name such as 'small' or 'large'.")] = None,
        name: Annotated[str | None, Field(description="A label for the session, for you and people.")] = None,
    ) -> CallToolResult:
        """Start another sandbox session with its own kernel and /workspace, and return its
        session_id; pass that id to the other tools to work in it. Close it when done."""
        options: dict[str, Any] = {"profile": profile, "metadata": {"name": name} if name else {}}
        try:
            managed = await self.resolver(ctx).create(options)
        except SandkernelError as err:
            raise _tool_error(err) from err
        return _result(f"session {managed.id} started", _summary(managed))

    async def close_session(
        self, ctx: Context, session_id: Annotated[str, Field(description="The session to end.")]
    ) -> CallToolResult:
        """End a session: its kernel, variables and /workspace files are gone; its notebook stays."""
        try:
            await self.resolver(ctx).close(session_id)
        except SandkernelError as err:
            raise _tool_error(err) from err
        return _result(f"session {session_id} closed", {"session_id": session_id})

    async def list_sessions(self, ctx: Context) -> CallToolResult:
        """List your live sessions (ids, names, profiles, whether busy)."""
        sessions = [_summary(m) for m in self.resolver(ctx).sessions()]
        lines = [f"{s['session_id']}  {s['name'] or '-'}  {s['profile']}  {s['state']}" for s in sessions]
        return _result("\n".join(lines) or "(no sessions yet)", {"sessions": sessions})

    async def notebook(self, session_id: str, ctx: Context) -> str:
        """The session's transcript: an .ipynb document of every run, by every door."""
        try:
            managed = await self.resolver(ctx).session_for(session_id)
        except SandkernelError as err:
            raise ResourceError(str(err)) from err
        if managed.recorder is None:
            raise ResourceError("this session has no notebook")
        await managed.recorder.flushed()
        return json.dumps(managed.recorder.notebook)


def _summary(managed: ManagedSession) -> dict[str, Any]:
    return {
        "session_id": managed.id,
        "name": managed.metadata.get("name", ""),
        "profile": managed.session.profile.name,
        "state": managed.execution_state,
        "created": managed.created,
        "notebook": NOTEBOOK_URI.format(session_id=managed.id),
    }


READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)


def build_mcp_server(resolver_for: ResolverFor, budget: OutputBudget, *, name: str = "sandkernel") -> MCPServer:
    """The MCP server with every tool and the notebook resource (see resolver.py for how a
    transport runs it and what ``resolver_for`` gets)."""
    if not callable(resolver_for):
        raise ConfigError("resolver_for must be a callable from a request context to a SessionResolver")
    server: MCPServer = MCPServer(name, instructions=INSTRUCTIONS, version=__version__)
    tools = McpTools(resolver_for, budget)
    closed = ToolAnnotations(open_world_hint=False)
    table = [
        (tools.run_python, closed),
        (tools.run_shell, closed),
        (tools.upload_file, ToolAnnotations(destructive_hint=True, idempotent_hint=True, open_world_hint=False)),
        (tools.download_file, READ_ONLY),
        (tools.list_files, READ_ONLY),
        (tools.list_variables, READ_ONLY),
        (tools.interrupt, closed),
        (tools.restart, ToolAnnotations(destructive_hint=True, open_world_hint=False)),
        (tools.create_session, closed),
        (tools.close_session, ToolAnnotations(destructive_hint=True, open_world_hint=False)),
        (tools.list_sessions, READ_ONLY),
    ]
    for fn, hints in table:
        server.add_tool(fn, name=fn.__name__, annotations=hints, structured_output=False)
    server.resource(
        NOTEBOOK_URI,
        name="notebook",
        description="The session's notebook: every run of every door, as an .ipynb (JSON) document.",
        mime_type="application/x-ipynb+json",
    )(tools.notebook)
    return server
