"""The MCP server: sandkernel's sessions as tools a model calls, and each session's notebook.

Built on the official SDK's high-level server (``mcp.server.mcpserver.MCPServer``): tool schemas
come from the signatures below, and each tool returns a ``CallToolResult`` of its own, because
what a model needs is more than a string: the text of a run, its images as MCP image content,
``isError`` when the code failed (with the traceback in the text), and ``structuredContent``
(status, execution count, duration, truncation) for a client that reads fields.

The tools never decide whose session they touch: each call asks the transport's
:data:`~sandkernel.gateway.mcp.resolver.ResolverFor` for the caller's resolver (resolver.py).
Executions are recorded in the session's transcript with ``source: "mcp"``, budgeted like the
session API's replies (gateway/service.py, the one way every door runs code). A bad argument or a refusal
(unknown session, path outside /workspace, a limit) comes back as a tool error that says what to
fix; nothing a caller sends can crash the server (the SDK turns any other exception into a
generic tool error and logs it).

The snapshot tools (pause, resume, fork, rewind) call the gateway's SnapshotManager
(gateway/snapshots.py) as the session API does, and say how each state came back: restored by
replay, with a verdict per re-run cell, never passed off as exact.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import mimetypes
import re
from typing import Annotated, Any, Protocol, runtime_checkable

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
from sandkernel.gateway.managed import RESTART_UNDER_WAY, ManagedSession, PausedSession, record_model
from sandkernel.gateway.mcp.resolver import ResolverFor, SessionResolver
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.service import SessionService, checked_code
from sandkernel.gateway.snapshots import MAX_FORKS, SnapshotManager
from sandkernel.images import fit_image
from sandkernel.kernels.sandbox.workspace_files import MAX_FILE_BYTES
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
(resource sandkernel://sessions/{session_id}/notebook). A session can be forked (try several
approaches from one state), rewound (undo cells that broke the state) and paused (kept on disk
while idle; the next call resumes it)."""

SessionId = Annotated[
    str | None,
    Field(
        description="The session to act on, as named by an earlier result or create_session; "
        "omit it on your first call to start one."
    ),
]
TargetId = Annotated[
    str | None,
    Field(description="The session, as named by an earlier result or list_sessions; omit it for your default session."),
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


def _check_session_id(session_id: str | None) -> None:
    if session_id is not None and (not session_id or len(session_id) > 200):
        raise ToolError("session_id must be a session id from create_session or list_sessions")


@runtime_checkable
class TenantScope(Protocol):
    """What the snapshot tools need of a resolver beyond :class:`SessionResolver`: the registry
    (its SnapshotManager), the caller's tenant, the default session's id and the ids it started
    (a fork joins them, so it ends with the caller like a created session). Every resolver of the
    gateway's doors is a :class:`~sandkernel.gateway.mcp.resolver.TenantResolver`, which has them."""

    registry: SessionRegistry
    tenant: str
    default_id: str | None
    started: set[str]


VERDICT_NOTE_CHARS = 300  # a verdict's note as the model reads it (the notebook keeps the diff)


def _restore_summary(reply: dict[str, Any]) -> dict[str, Any]:
    """How a state came back, compact: the mechanism, whether every re-run cell agreed with the
    record, where the files came from, and one entry per cell (a note only where there is one)."""
    cells = [
        {
            "cell": c["cell"],
            "verdict": c["verdict"],
            **({"note": clip_text(c["note"], VERDICT_NOTE_CHARS).text} if c.get("note") else {}),
        }
        for c in reply.get("cells") or ()
    ]
    return {
        "restored_by": reply.get("restored_by"),
        "reproduced": reply.get("reproduced"),
        "files": reply.get("files"),
        "seconds": reply.get("seconds"),
        "cells": cells,
        "notes": list(reply.get("notes") or ()),
    }


def _restore_text(summary: dict[str, Any]) -> str:
    """One line a model can act on: what was re-run, and which cells came out differently."""
    cells = summary["cells"]
    ran = sum(1 for c in cells if c["verdict"] != "not run")
    text = f"restored by {summary['restored_by']}: {ran} cell(s) re-run"
    if summary["reproduced"]:
        text += ", every one as recorded"
    else:
        differ = [c for c in cells if c["verdict"] not in ("same", "not run")]
        text += "; differing from the record: " + "; ".join(
            f"cell {c['cell']} {c['verdict']}" + (f" ({c['note']})" if c.get("note") else "") for c in differ
        )
        text += " (their variables may not be what they were: check them before relying on them)"
    text += f"; files from the {summary['files']}"
    return "; ".join([text, *summary["notes"]])


def _model_summary(model: dict[str, Any]) -> dict[str, Any]:
    """What list_sessions says of a session known by its model (paused here, or on another host)."""
    return {
        "session_id": model["id"],
        "name": model["name"],
        "profile": model["profile"].get("name", ""),
        "state": model["kernel"]["execution_state"] if model["state"] == "running" else model["state"],
        "created": model["created"],
        "notebook": NOTEBOOK_URI.format(session_id=model["id"]),
    }


def _paused_summary(paused: PausedSession) -> dict[str, Any]:
    model = paused.session_model()
    return {**_model_summary(model), "snapshot": model["snapshot"]}


class McpTools:
    """The tools and the notebook resource of one MCP server; every call resolves its caller."""

    def __init__(self, resolver_for: ResolverFor, service: SessionService) -> None:
        self.resolver_for = resolver_for
        self.service = service  # runs the code, for every door alike (gateway/service.py)
        self.budget = service.budget

    def resolver(self, ctx: Context) -> SessionResolver:
        try:
            return self.resolver_for(ctx.request_context)
        except SandkernelError as err:
            raise _tool_error(err) from err

    def scope(self, ctx: Context) -> tuple[TenantScope, SnapshotManager]:
        """The caller's resolver as a tenant scope, and the gateway's snapshot manager."""
        resolver = self.resolver(ctx)
        if isinstance(resolver, TenantScope) and isinstance(resolver.registry.snapshots, SnapshotManager):
            return resolver, resolver.registry.snapshots
        raise ToolError("this sandkernel server keeps no snapshots: pause, resume, fork and rewind are not available")

    def target(self, scope: TenantScope, session_id: str | None, verb: str) -> str:
        """The id a pause or resume acts on: the one named, else the caller's default session
        (never started for it: there is nothing to pause or resume in a new one)."""
        _check_session_id(session_id)
        if session_id is not None:
            return session_id
        if scope.default_id is None:
            raise ToolError(f"there is no default session to {verb}: pass session_id (list_sessions shows yours)")
        return scope.default_id

    async def managed(self, ctx: Context, session_id: str | None) -> ManagedSession:
        _check_session_id(session_id)
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
        try:
            checked_code(code)  # before a default session is started for it
        except SandkernelError as err:
            raise _tool_error(err) from err
        managed = await self.managed(ctx, session_id)
        try:
            result = await self.service.execute(managed, SOURCE, code, _check_timeout(timeout))
        except SandkernelError as err:
            raise _tool_error(err) from err
        reply = self.service.reply(result)
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
        try:
            reply = await self.service.shell(managed, SOURCE, command, _check_timeout(timeout))
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
        path: Annotated[
            str,
            Field(
                description="Where to write it: relative to /workspace ('data/sales.csv'), or an absolute path "
                "the sandbox's user may write ('/tmp/run/input.json'); missing directories are made."
            ),
        ],
        content: Annotated[str, Field(description="The file's content: text, or base64 for binary files.")],
        encoding: Annotated[str, Field(description="'text' (UTF-8) or 'base64'.")] = "text",
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Write a file into the sandbox (replacing it if it exists), for your code to read. Text
        is written as UTF-8; send binary files base64-encoded with encoding 'base64'."""
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
            written = await self.service.write_file(managed, SOURCE, path, data)
        except SandkernelError as err:
            raise _tool_error(err) from err
        where = written.get("path", path)
        shown = where if where.startswith("/") else f"/workspace/{where}"
        return _result(f"wrote {len(data)} bytes to {shown}", {"session_id": managed.id, **written})

    async def download_file(
        self,
        ctx: Context,
        path: Annotated[str, Field(description="The file: relative to /workspace, or an absolute path.")],
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Read a file from the sandbox (a relative path is in /workspace). Text files come back as text (long ones cut
        in the middle), images as images, other binary files as an embedded base64 resource.
        For large data, summarise it with run_python instead of reading it whole."""
        managed = await self.managed(ctx, session_id)
        try:
            data = await self.service.read_file(managed, path)
        except SandkernelError as err:
            raise _tool_error(err) from err
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
        path: Annotated[
            str, Field(description="A directory: relative to /workspace ('' is /workspace), or an absolute path.")
        ] = "",
        session_id: SessionId = None,
    ) -> CallToolResult:
        """List a directory of the sandbox (a relative path is in /workspace): names, types and sizes."""
        managed = await self.managed(ctx, session_id)
        try:
            entries = await self.service.list_files(managed, path)
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
            variables = await self.service.variables(managed)
        except SandkernelError as err:
            raise _tool_error(err) from err
        lines = [", ".join(f"{k}={v}" for k, v in var.items() if v is not None) for var in variables]
        text = clip_text("\n".join(lines) or "(no variables)", self.budget.max_text_bytes).text
        return _result(text, {"session_id": managed.id, "variables": variables})

    async def interrupt(self, ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """Interrupt the code running in the session (KeyboardInterrupt); variables are kept."""
        managed = await self.managed(ctx, session_id)
        try:
            sent = await self.service.interrupt(managed, SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        return _result("interrupted" if sent else RESTART_UNDER_WAY, {"session_id": managed.id, "interrupted": sent})

    async def restart(self, ctx: Context, session_id: SessionId = None) -> CallToolResult:
        """Restart the session's kernel: all variables and imports are lost, files in /workspace
        are kept. Use it when the kernel is stuck or its state is broken."""
        managed = await self.managed(ctx, session_id)
        try:
            await self.service.restart(managed, SOURCE)
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
        """List your sessions (ids, names, profiles, whether busy or paused)."""
        resolver = self.resolver(ctx)
        sessions = [_summary(m) for m in resolver.sessions()]
        if isinstance(resolver, TenantScope):
            paused = [p for p in resolver.registry.paused_sessions() if p.tenant == resolver.tenant]
            sessions += [_paused_summary(p) for p in paused]
            sessions += await _held_elsewhere(resolver, {s["session_id"] for s in sessions})
        lines = [f"{s['session_id']}  {s['name'] or '-'}  {s['profile']}  {s['state']}" for s in sessions]
        return _result("\n".join(lines) or "(no sessions yet)", {"sessions": sessions})

    # -- snapshots ----------------------------------------------------------------------------

    async def pause_session(self, ctx: Context, session_id: TargetId = None) -> CallToolResult:
        """Pause a session to disk: its files are kept exactly and its variables are rebuilt later
        by re-running its cells, while its sandbox is removed (no memory or CPU held).

        Use it to keep an expensive state (loaded data, a trained model) while you do something
        else for a long time. Nothing else is needed to come back: the next run_python,
        run_shell or file call on the session resumes it by itself (resume_session does it
        explicitly and reports how each cell came back). A session running code cannot be paused."""
        scope, manager = self.scope(ctx)
        sid = self.target(scope, session_id, "pause")
        try:
            await scope.registry.settled(sid, scope.tenant)  # a resume or fork under way finishes first
            paused = scope.registry.paused(scope.tenant, sid)
            if paused is not None:
                return _result(
                    f"session {sid} is already paused",
                    {"session_id": sid, "state": "paused", "snapshot": paused.snapshot},
                )
            reply = await manager.pause(scope.registry.get(scope.tenant, sid), SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        snapshot = reply["snapshot"]
        text = (
            f"session {sid} paused in {reply['seconds']} s: its files ({snapshot.get('bytes')} bytes) are kept and "
            "its sandbox is stopped; run code in it (or call resume_session) to bring it back"
        )
        return _result(
            text, {"session_id": sid, "state": reply["state"], "snapshot": snapshot, "seconds": reply["seconds"]}
        )

    async def resume_session(self, ctx: Context, session_id: TargetId = None) -> CallToolResult:
        """Resume a paused session now, and say how its state came back.

        Optional: run_python, run_shell and the file tools resume a paused session by themselves.
        Call it to resume ahead of time or to see the report: the files are restored exactly; the
        variables are rebuilt by re-running the session's cells, each judged against its recorded
        output (a cell with unseeded randomness, the clock or the network may come out differently).
        A session that is running already is left as it is."""
        scope, manager = self.scope(ctx)
        sid = self.target(scope, session_id, "resume")
        try:
            reply = await manager.resume(scope.tenant, sid, SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        if reply.get("restored_by") is None:
            return _result(f"session {sid} is running: nothing to resume", {"session_id": sid, "state": reply["state"]})
        summary = _restore_summary(reply)
        text = f"session {sid} resumed, {_restore_text(summary)}"
        return _result(text, {"session_id": sid, "state": reply["state"], **summary})

    async def fork_session(
        self,
        ctx: Context,
        count: Annotated[int, Field(description=f"How many copies to make, 1 to {MAX_FORKS}.")] = 1,
        cell: Annotated[
            int | None,
            Field(
                description="Fork the state right after this code cell (numbered from 1 in the session's "
                "notebook) instead of the state now."
            ),
        ] = None,
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Copy a session into new, independent sessions with the same variables and files, and
        return their session ids.

        Use it to try different approaches from one point without redoing the work that led there:
        fork, then run one approach in each fork (pass the fork's session_id) and keep the one that
        works; the original session is left unchanged. Close the forks you no longer need. Each
        fork is a fresh sandbox whose variables are rebuilt by re-running the cells; the result says,
        per fork, whether every cell came out as recorded."""
        if isinstance(count, bool) or not 1 <= count <= MAX_FORKS:
            raise ToolError(f"count must be a whole number of forks from 1 to {MAX_FORKS}, not {count!r}")
        scope, manager = self.scope(ctx)
        managed = await self.managed(ctx, session_id)
        try:
            forks = await manager.fork(managed, count, cell, SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        made = [{"session_id": fork["session"]["id"], **_restore_summary(fork)} for fork in forks]
        scope.started.update(f["session_id"] for f in made)  # they end with the caller, as created ones do
        where = "its current state" if cell is None else f"its state right after cell {cell}"
        lines = [f"forked session {managed.id} ({where}) into {len(made)} new session(s):"]
        lines += [f"- {f['session_id']}: {_restore_text(f)}" for f in made]
        lines.append("pass a fork's session_id to work in it; the original session is unchanged")
        return _result("\n".join(lines), {"session_id": managed.id, "cell": cell, "forks": made})

    async def rewind_session(
        self,
        ctx: Context,
        cell: Annotated[
            int,
            Field(
                description="The code cell whose state to return to, numbered from 1 in the session's notebook "
                "(every run_python and run_shell call, by any client, is a cell; a fork's notebook starts with "
                "its parent's)."
            ),
        ],
        session_id: SessionId = None,
    ) -> CallToolResult:
        """Return a session to its state right after an earlier cell: the variables and files that
        later cells made are gone.

        Use it to undo cells that broke the state (a variable overwritten, data mangled in place, a
        bad import) instead of restarting and redoing everything. The notebook keeps every cell and
        records the rewind. The variables are rebuilt by re-running the cells up to that one; the
        result says whether each came out as recorded. A wrong cell number is refused with the
        range of valid ones."""
        _, manager = self.scope(ctx)
        managed = await self.managed(ctx, session_id)
        try:
            reply = await manager.rewind(managed, cell, SOURCE)
        except SandkernelError as err:
            raise _tool_error(err) from err
        summary = _restore_summary(reply)
        text = f"session {managed.id} rewound to right after cell {cell}, {_restore_text(summary)}"
        structured = {"session_id": managed.id, "state": reply["state"], "rewound_to": cell, **summary}
        return _result(text, structured)

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


def notebook_session(uri: Any) -> str | None:
    """The session id in a notebook resource's URI (:data:`NOTEBOOK_URI`), or None."""
    prefix, _, suffix = NOTEBOOK_URI.partition("{session_id}")
    if not isinstance(uri, str) or not uri.startswith(prefix) or not uri.endswith(suffix):
        return None
    session_id = uri[len(prefix) : len(uri) - len(suffix)]
    return session_id if session_id and "/" not in session_id else None


async def _held_elsewhere(scope: TenantScope, listed: set[str]) -> list[dict[str, Any]]:
    """In a cluster, the tenant's sessions other hosts hold, from the catalog (what GET
    /api/sessions lists for them): a modern MCP call naming one is forwarded to its host
    (gateway/mcp/http.py). A catalog that cannot answer is a tool error saying so."""

    cluster = getattr(scope.registry, "cluster", None)
    if cluster is None:
        return []
    try:
        records = await cluster.tenant_sessions(scope.tenant)
    except SandkernelError as err:
        raise _tool_error(err) from err
    return [_model_summary(record_model(r)) for r in records if r.session_id not in listed]


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


def build_mcp_server(resolver_for: ResolverFor, service: SessionService, *, name: str = "sandkernel") -> MCPServer:
    """The MCP server with every tool and the notebook resource (see resolver.py for how a
    transport runs it and what ``resolver_for`` gets)."""
    if not callable(resolver_for):
        raise ConfigError("resolver_for must be a callable from a request context to a SessionResolver")
    server: MCPServer = MCPServer(name, instructions=INSTRUCTIONS, version=__version__)
    tools = McpTools(resolver_for, service)
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
        (tools.pause_session, ToolAnnotations(destructive_hint=False, idempotent_hint=True, open_world_hint=False)),
        (tools.resume_session, ToolAnnotations(destructive_hint=False, idempotent_hint=True, open_world_hint=False)),
        (tools.fork_session, ToolAnnotations(destructive_hint=False, open_world_hint=False)),
        (tools.rewind_session, ToolAnnotations(destructive_hint=True, open_world_hint=False)),
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
