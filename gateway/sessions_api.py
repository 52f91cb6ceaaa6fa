"""The session API for agents: create a sandbox, execute code (whole or streamed), interrupt,
restart, delete. Replies carry budgeted outputs; see budget.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from tornado.iostream import StreamClosedError

from sandkernel.errors import SandkernelError
from sandkernel.gateway.base import ApiError, BaseHandler
from sandkernel.gateway.budget import OutputBudget, apply_budget
from sandkernel.gateway.registry import ManagedSession

KEEPALIVE_SECONDS = 10.0
MAX_CODE_BYTES = 1024 * 1024


class SessionsHandler(BaseHandler):
    def get(self) -> None:
        self.write_json([s.session_model() for s in self.registry.list(self.tenant)])

    async def post(self) -> None:
        body = self.json_body()
        profile = body.get("profile")
        limits = body.get("limits", body.get("overrides")) or {}
        metadata = body.get("metadata") or {}
        if profile is not None and not isinstance(profile, str):
            raise ApiError(400, "profile must be a profile name such as 'default', 'small' or 'large'")
        if not isinstance(limits, dict) or not isinstance(metadata, dict):
            raise ApiError(400, "limits and metadata must be JSON objects")
        try:
            managed = await self.call(self.registry.create(self.tenant, profile, limits, metadata))
        except ApiError as err:
            if err.status_code == 429:
                self.settings_["metrics"].limit_hits.labels("sessions").inc()
            raise
        self.set_header("Location", f"/api/sessions/{managed.id}")
        self.write_json(managed.session_model(), status=201)


class ProfilesHandler(BaseHandler):
    """GET the profiles a tenant may pick, their defaults and ceilings (what ``limits`` may ask)."""

    def get(self) -> None:
        self.write_json(self.registry.catalog.describe())


class SessionHandler(BaseHandler):
    def managed(self, session_id: str) -> ManagedSession:
        try:
            return self.registry.get(self.tenant, session_id)
        except LookupError:
            raise ApiError(404, f"no session {session_id!r}") from None

    def get(self, session_id: str) -> None:
        self.write_json(self.managed(session_id).session_model())

    async def delete(self, session_id: str) -> None:
        self.managed(session_id)
        keep = self.get_query_argument("delete_notebook", "0") not in ("1", "true")
        await self.call(self.registry.delete(self.tenant, session_id, keep_notebook=keep))
        self.set_status(204)
        self.finish()


class SessionActionHandler(SessionHandler):
    async def post(self, session_id: str, action: str) -> None:
        managed = self.managed(session_id)
        if action == "interrupt":
            await self.call(managed.session.interrupt())
            self.set_status(204)
            self.finish()
        else:
            await self.call(managed.session.restart())
            self.write_json(managed.session_model())


class ExecuteHandler(SessionHandler):
    """POST {code, timeout?} → the result; with ``?stream=1`` (or Accept: application/x-ndjson)
    an NDJSON stream of ``{"type": "output"}`` lines, keepalives, then ``{"type": "result"}``.
    A streaming client that disconnects interrupts its execution."""

    def budget(self) -> OutputBudget:
        return self.settings_.get("budget") or OutputBudget()

    async def post(self, session_id: str) -> None:
        managed = self.managed(session_id)
        body = self.json_body()
        code = body.get("code")
        if not isinstance(code, str):
            raise ApiError(400, "'code' must be a string of Python source", "bad_code")
        if len(code.encode()) > MAX_CODE_BYTES:
            raise ApiError(413, f"code is larger than {MAX_CODE_BYTES} bytes; upload a file and run it instead")
        timeout = body.get("timeout")
        tag = body.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise ApiError(400, "'tag' must be a string (e.g. the agent's tool-call id)")
        streaming = self.get_query_argument("stream", "") in ("1", "true") or "application/x-ndjson" in (
            self.request.headers.get("Accept") or ""
        )
        managed.touch("busy")
        try:
            if streaming:
                await self._stream(managed, code, timeout, tag)
            else:
                result = await self.call(managed.session.execute(code, timeout=timeout, tag=tag, source="session_api"))
                self.write_json(self._reply(result))
        finally:
            managed.touch("idle")

    def _reply(self, result: Any) -> dict[str, Any]:
        data = result.to_dict()
        data["outputs"], data["truncation"] = apply_budget(data["outputs"], self.budget())
        if result.chars_cut or result.outputs_dropped or result.bytes_omitted:
            data["truncation"]["truncated"] = True
        self.settings_["metrics"].record_execution(result, data["truncation"]["truncated"])
        data["text"] = "".join(
            o["text"] if o["output_type"] == "stream" else o.get("data", {}).get("text/plain", "") + "\n"
            for o in data["outputs"]
            if o["output_type"] != "error"
        )
        return data

    async def _stream(self, managed: ManagedSession, code: str, timeout: Any, tag: str | None) -> None:
        self.set_header("Content-Type", "application/x-ndjson")
        self.set_header("Cache-Control", "no-cache")
        sent_bytes = 0
        budget = self.budget()
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
            nonlocal sent_bytes
            if sent_bytes >= budget.max_text_bytes:
                return
            [budgeted], _ = apply_budget([output], OutputBudget(budget.max_text_bytes - sent_bytes, budget.max_images))
            sent_bytes += len(json.dumps(budgeted))
            await send({"type": "output", "output": budgeted})

        async def keepalive() -> None:
            while True:
                await asyncio.sleep(KEEPALIVE_SECONDS)
                await send({"type": "keepalive"})

        async def interrupt_on_disconnect() -> None:
            await disconnected.wait()
            with contextlib.suppress(SandkernelError, RuntimeError):
                await managed.session.interrupt()

        helpers = [asyncio.create_task(keepalive()), asyncio.create_task(interrupt_on_disconnect())]
        try:
            result = await self.call(
                managed.session.execute(code, timeout=timeout, on_output=on_output, tag=tag, source="session_api")
            )
            await send({"type": "result", "result": self._reply(result)})
        finally:
            for task in helpers:
                task.cancel()
        if not disconnected.is_set():
            self.finish()


class NotebookHandler(SessionHandler):
    """GET the session's transcript (an .ipynb document)."""

    async def get(self, session_id: str) -> None:
        recorder = self.managed(session_id).session.recorder
        if recorder is None:
            raise ApiError(404, "this session has no transcript")
        await recorder.flushed()  # what we return is what is on disk
        self.set_header("Content-Disposition", f'attachment; filename="{recorder.path.name}"')
        self.write_json(recorder.notebook)


class MarkdownHandler(SessionHandler):
    """POST {text}: add a markdown cell (the agent's reasoning) to the transcript."""

    async def post(self, session_id: str) -> None:
        recorder = self.managed(session_id).session.recorder
        text = self.json_body().get("text")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "'text' must be a non-empty string of markdown")
        if recorder is None:
            raise ApiError(404, "this session has no transcript")
        await recorder.add_markdown(text)
        self.set_status(204)
        self.finish()
