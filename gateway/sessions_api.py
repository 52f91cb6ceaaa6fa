"""The session API for agents: create a sandbox, execute code (whole or streamed), interrupt,
restart, delete. Replies carry budgeted outputs; see budget.py.

A streamed execute (``?stream=1``) sends NDJSON lines: ``{"type": "output", "output": ...}`` once
per output as it happens, ``{"type": "keepalive"}`` every 10 s, then one
``{"type": "result", "result": ...}``: the reply's summary (status, error, execution count,
timings, truncation, ``streamed``: how many output lines were sent) whose ``outputs`` hold only
what the stream did not carry (an error output that was not streamed). A client rebuilds the
whole reply as the streamed outputs followed by the result's. The stream spends the same budget
as a whole reply (:func:`~sandkernel.gateway.budget.apply_budget`, output by output): once it is
spent, text outputs are counted in ``truncation`` instead of sent; an error output is never
withheld. Errors raised before the first line are ordinary JSON errors; after it, an
``{"type": "error", "error": code, "message": ...}`` line ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from tornado.iostream import StreamClosedError

from sandkernel import doors
from sandkernel.errors import SandkernelError
from sandkernel.gateway.base import BaseHandler, error_reply
from sandkernel.gateway.budget import OutputBudget, apply_budget
from sandkernel.gateway.http_api import ApiError
from sandkernel.gateway.managed import RESTART_UNDER_WAY, LostSession, ManagedSession, PausedSession, record_model
from sandkernel.gateway.service import checked_code, client_door
from sandkernel.gateway.session_metadata import checked_metadata
from sandkernel.kernels.execution.outputs import ExecutionResult

KEEPALIVE_SECONDS = 10.0


class SessionsHandler(BaseHandler):
    """GET the tenant's sessions (in a cluster: on every host, from the catalog); POST a new one
    (in a cluster: on the host with most room that runs its runtime, see
    gateway/cluster/placement.py)."""

    async def get(self) -> None:
        models = self.registry.models(self.tenant)
        cluster = self.cluster
        if cluster is not None and self.forwarded_from is None:
            here = {model["id"] for model in models}
            records = await cluster.tenant_sessions(self.tenant)
            models += [record_model(r) for r in records if r.session_id not in here]
        self.write_json(models)

    async def post(self) -> None:
        body = self.json_body()
        profile = body.get("profile")
        limits = body.get("limits", body.get("overrides")) or {}
        metadata = checked_metadata(body.get("metadata"))  # before it is placed or forwarded
        if profile is not None and not isinstance(profile, str):
            raise ApiError(400, "profile must be a profile name such as 'default', 'small' or 'large'")
        if not isinstance(limits, dict):
            raise ApiError(400, "limits must be a JSON object")
        managed = await self.create_session(profile, limits, metadata, origin="session_api")
        if managed is None:  # placed on another host, which answered
            return
        self.set_header("Location", f"/api/sessions/{managed.id}")
        self.write_json(managed.session_model(), status=201)


class ProfilesHandler(BaseHandler):
    """GET the profiles a tenant may pick, their defaults and ceilings (what ``limits`` may ask)."""

    def get(self) -> None:
        self.write_json(self.registry.catalog.describe())


class SessionScoped(BaseHandler):
    """Base of the handlers under ``/api/sessions/{id}``: finds the caller's session. It serves no
    verb itself, so a subclass answers exactly the verbs it defines (and openapi.json lists)."""

    def managed(self, session_id: str) -> ManagedSession:
        """The caller's live session (KernelNotFoundError, a 404, for another tenant's or none;
        SandboxLostError, a 410 that says to delete it, for a lost one)."""
        return self.registry.get(self.tenant, session_id)

    async def live(self, session_id: str) -> ManagedSession:
        """The caller's session, resumed first if it is paused: for the calls that run code or
        touch its files, so an agent never has to know its session was paused."""
        return await self.registry.live(self.tenant, session_id, doors.SESSION_API)


class SessionHandler(SessionScoped):
    """GET the session model (a lost session's too: state ``lost`` and why); DELETE the session
    (its container, or a lost one's leftovers; the transcript is kept unless asked)."""

    serves_session_model = True

    async def get(self, session_id: str) -> None:
        await self.registry.settled(session_id, self.tenant)
        self.write_json(self.registry.find(self.tenant, session_id).session_model())

    async def delete(self, session_id: str) -> None:
        await self.registry.settled(session_id, self.tenant)
        self.registry.find(self.tenant, session_id)
        keep = self.get_query_argument("delete_notebook", "0") not in ("1", "true")
        await self.registry.delete(self.tenant, session_id, keep_notebook=keep)
        self.set_status(204)
        self.finish()


class SessionActionHandler(SessionScoped):
    """POST interrupt or restart (the same implementation as the kernel API's: the session service's)."""

    async def post(self, session_id: str, action: str) -> None:
        managed = await self.registry.for_kernel_call(self.tenant, session_id)
        if action == "interrupt":
            if await self.service.interrupt(managed, doors.SESSION_API):
                self.set_status(204)
                self.finish()
            else:
                self.write_json({"interrupted": False, "reason": RESTART_UNDER_WAY})
        else:
            await self.service.restart(managed, doors.SESSION_API)
            self.write_json(managed.session_model())


class StreamBudget:
    """The reply budget, spent output by output as a stream goes.

    Each output passes through :func:`apply_budget` with what is left of the text and image
    budgets, so a streamed reply is cut exactly where a whole one would be. What an output spent
    is measured with the same function (the bytes a zero budget cuts are all its text bytes), so
    which MIME types count as text or images is decided in budget.py alone."""

    def __init__(self, budget: OutputBudget) -> None:
        self.budget = budget
        self.text_left = budget.max_text_bytes
        self.images_left = budget.max_images
        self.text_bytes_cut = 0
        self.images_omitted = 0
        self.withheld = 0  # outputs not sent: nothing of them fit
        self.sent = 0
        self.error_sent = False

    def take(self, output: dict[str, Any]) -> dict[str, Any] | None:
        """The output as the stream sends it, or None when none of its text or images fit (it
        is counted instead). An error output is always returned (apply_budget keeps them whole)."""
        _, whole = apply_budget([output], OutputBudget(0, 0, self.budget.max_image_bytes))
        [sent], spent = apply_budget(
            [output], OutputBudget(self.text_left, self.images_left, self.budget.max_image_bytes)
        )
        kept_text = whole["text_bytes_cut"] - spent["text_bytes_cut"]
        kept_images = whole["images_omitted"] - spent["images_omitted"]
        self.text_left -= kept_text
        self.images_left -= kept_images
        self.text_bytes_cut += spent["text_bytes_cut"]
        self.images_omitted += spent["images_omitted"]
        has_content = whole["text_bytes_cut"] or whole["images_omitted"]
        if output["output_type"] != "error" and has_content and not (kept_text or kept_images):
            self.withheld += 1
            return None
        self.sent += 1
        self.error_sent = self.error_sent or output["output_type"] == "error"
        return sent

    def truncation(self, result: ExecutionResult) -> dict[str, Any]:
        """The reply's ``truncation`` for what this stream cut (and what the session layer cut)."""
        cut = bool(self.text_bytes_cut or self.images_omitted or self.withheld)
        return {
            "truncated": cut or bool(result.chars_cut or result.outputs_dropped or result.bytes_omitted),
            "text_bytes_cut": self.text_bytes_cut,
            "images_omitted": self.images_omitted,
            "outputs_withheld": self.withheld,
            "max_text_bytes": self.budget.max_text_bytes,
        }


class ExecuteHandler(SessionScoped):
    """POST {code, timeout?} → the result; with ``?stream=1`` (or Accept: application/x-ndjson)
    an NDJSON stream (see the module docstring). A streaming client that disconnects interrupts
    its execution."""

    async def post(self, session_id: str) -> None:
        body = self.json_body()
        managed = await self.live(session_id)
        code = checked_code(body.get("code"))  # before a stream's headers: a bad one is a plain 4xx
        timeout = body.get("timeout")
        tag = body.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise ApiError(400, "'tag' must be a string (e.g. the agent's tool-call id)")
        source = client_door(body.get("source"), doors.SESSION_API)
        streaming = self.get_query_argument("stream", "") in ("1", "true") or "application/x-ndjson" in (
            self.request.headers.get("Accept") or ""
        )
        if streaming:
            await self._stream(managed, code, timeout, tag, source)
        else:
            # Answered before the observers record it (same turn of the event loop; see execute).
            await self.service.execute(managed, source, code, timeout, tag=tag, on_result=self._answer)

    def _answer(self, result: ExecutionResult) -> None:
        self.write_json(self.service.reply(result))

    def _summary(self, result: ExecutionResult, budget: StreamBudget) -> dict[str, Any]:
        """The last line of a stream: the reply without the outputs the stream carried."""
        data = result.to_dict()
        outputs = data.pop("outputs")
        leftovers = [o for o in outputs if o["output_type"] == "error"] if not budget.error_sent else []
        data["outputs"] = leftovers
        data["streamed"] = budget.sent
        data["truncation"] = budget.truncation(result)
        self.service.count_truncated(data["truncation"])
        return data

    async def _stream(self, managed: ManagedSession, code: str, timeout: Any, tag: str | None, source: str) -> None:
        self.set_header("Content-Type", "application/x-ndjson")
        self.set_header("Cache-Control", "no-cache")
        budget = StreamBudget(self.service.budget)
        disconnected = asyncio.Event()
        self.request.connection.set_close_callback(disconnected.set)

        async def send(line: dict[str, Any]) -> None:
            if disconnected.is_set():
                return
            try:
                self.write(json.dumps(line, default=str) + "\n")
                await self.flush()
            except StreamClosedError:
                disconnected.set()

        async def on_output(output: dict[str, Any]) -> None:
            sent = budget.take(output)
            if sent is not None:
                await send({"type": "output", "output": sent})

        async def keepalive() -> None:
            while True:
                await asyncio.sleep(KEEPALIVE_SECONDS)
                await send({"type": "keepalive"})

        async def interrupt_on_disconnect() -> None:
            await disconnected.wait()
            with contextlib.suppress(SandkernelError, RuntimeError):
                await self.service.interrupt(managed, doors.SESSION_API)

        helpers = [asyncio.create_task(keepalive()), asyncio.create_task(interrupt_on_disconnect())]
        try:
            result = await self.service.execute(managed, source, code, timeout, tag=tag, on_output=on_output)
        except SandkernelError as err:
            if not self._headers_written:
                raise  # nothing sent yet: an ordinary JSON error
            self.log_exception(type(err), err, err.__traceback__)
            status, error, message = error_reply(err)
            await send({"type": "error", "status": status, "error": error, "message": message})
        else:
            await send({"type": "result", "result": self._summary(result, budget)})
        finally:
            for task in helpers:
                task.cancel()
        if not disconnected.is_set():
            self.finish()


class ShellHandler(SessionScoped):
    """POST {command, timeout?, output_limit?, source?} → {status, exit_code, output, timed_out, truncated, ...}:
    a /bin/sh command run as a cell of the session's kernel (see :mod:`sandkernel.shell`)."""

    async def post(self, session_id: str) -> None:
        body = self.json_body()
        managed = await self.live(session_id)
        source = client_door(body.get("source"), doors.SESSION_API)
        reply = await self.service.shell(
            managed, source, body.get("command"), body.get("timeout"), body.get("output_limit")
        )
        self.write_json(reply)


class NotebookHandler(SessionScoped):
    """GET the session's transcript (an .ipynb document); a lost session's too (its record of
    what ran is what its tenant has left)."""

    async def get(self, session_id: str) -> None:
        found = self.registry.find(self.tenant, session_id)
        if isinstance(found, (LostSession, PausedSession)):
            await self._lost_transcript(found)
            return
        recorder = found.recorder
        if recorder is None:
            raise ApiError(404, "this session has no transcript")
        await recorder.flushed()  # what we return is what is on disk
        self.set_header("Content-Disposition", f'attachment; filename="{recorder.path.name}"')
        self.write_json(recorder.notebook)

    async def _lost_transcript(self, lost: LostSession | PausedSession) -> None:
        path = lost.record.gateway.get("transcript")
        if not isinstance(path, str):
            raise ApiError(404, "this session has no transcript")
        try:  # the path is the catalog's, which only the gateway writes
            notebook = json.loads(await asyncio.to_thread(Path(path).read_text))
        except (OSError, ValueError) as err:
            raise ApiError(404, f"the lost session's transcript cannot be read ({type(err).__name__})") from None
        self.set_header("Content-Disposition", f'attachment; filename="{Path(path).name}"')
        self.write_json(notebook)


class MarkdownHandler(SessionScoped):
    """POST {text}: add a markdown cell (the agent's reasoning) to the transcript."""

    async def post(self, session_id: str) -> None:
        recorder = self.managed(session_id).recorder
        text = self.json_body().get("text")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "'text' must be a non-empty string of markdown")
        if recorder is None:
            raise ApiError(404, "this session has no transcript")
        await recorder.add_markdown(text)
        self.set_status(204)
        self.finish()
