"""A local server that speaks enough of the Anthropic Messages API to play scripted conversations.

It is how the agent is tested with the real ``anthropic`` SDK and no internet (point the client's
``base_url`` at it), and how ``sandkernel demo`` runs without an API key. It serves
``POST /v1/messages`` in both forms, JSON and server-sent events (message_start,
content_block_start/delta/stop, message_delta, message_stop), with tool_use blocks, and checks
what the real API would refuse: a tool_use left without its tool_result, malformed image blocks,
roles out of order. Each scripted turn may also ``expect`` something of the request (e.g. that the
last tool result holds an image); a failed check is answered with a 400 naming it, so a test sees
exactly where the agent went off script.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

from tornado import httpserver, netutil, web

log = logging.getLogger(__name__)

Check = Callable[[dict[str, Any]], "str | None"]  # a request → a complaint, or None when fine


@dataclasses.dataclass
class ScriptedTurn:
    """One assistant reply. ``content`` holds text blocks and tool_use blocks (ids are filled in);
    ``expect`` checks the request that asks for this turn."""

    content: list[dict[str, Any]]
    expect: list[Check] = dataclasses.field(default_factory=list)


def say(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def call(name: str, **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "name": name, "input": tool_input}


# -- what a request must contain -----------------------------------------------------------


def last_tool_results(request: dict[str, Any]) -> list[dict[str, Any]]:
    last = request["messages"][-1]
    content = last["content"] if isinstance(last["content"], list) else []
    return [block for block in content if block.get("type") == "tool_result"]


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type") == "text")


def last_message_text(request: dict[str, Any]) -> str:
    """All text of the last user message: tool results and any text blocks beside them."""
    last = request["messages"][-1]
    if isinstance(last["content"], str):
        return last["content"]
    parts = []
    for block in last["content"]:
        parts.append(_result_text(block) if block.get("type") == "tool_result" else block.get("text", ""))
    return "\n".join(parts)


def result_contains(needle: str) -> Check:
    def check(request: dict[str, Any]) -> str | None:
        text = last_message_text(request)
        return None if needle in text else f"expected {needle!r} in the last tool result, got {text[:300]!r}"

    return check


def result_is_error(is_error: bool = True) -> Check:
    def check(request: dict[str, Any]) -> str | None:
        flags = [bool(block.get("is_error")) for block in last_tool_results(request)]
        return None if flags and flags[-1] is is_error else f"expected a tool result with is_error={is_error}"

    return check


def result_has_image(request: dict[str, Any]) -> str | None:
    for block in last_tool_results(request):
        for part in block.get("content") if isinstance(block.get("content"), list) else []:
            if part.get("type") == "image":
                return None
    return "expected an image block in the last tool result"


# -- the server ------------------------------------------------------------------------------


class ApiRefusal(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class ScriptedMessagesServer:
    """Plays ``turns`` in order, one per request; ``repeat_last`` replays the last turn forever
    (for loop-limit tests). Every request body is kept in :attr:`requests`."""

    def __init__(self, turns: list[ScriptedTurn], repeat_last: bool = False, model: str = "scripted") -> None:
        self.turns = turns
        self.repeat_last = repeat_last
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._server: httpserver.HTTPServer | None = None
        self.url = ""

    async def start(self) -> str:
        """Listen on a free loopback port; returns the base URL for ``Anthropic(base_url=...)``."""
        app = web.Application([(r"/v1/messages", _MessagesHandler, {"owner": self})])
        sockets = netutil.bind_sockets(0, "127.0.0.1")
        self._server = httpserver.HTTPServer(app)
        self._server.add_sockets(sockets)
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            await self._server.close_all_connections()
            self._server = None

    async def __aenter__(self) -> ScriptedMessagesServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def reply_to(self, request: dict[str, Any]) -> dict[str, Any]:
        """The message for this request (checking it first), as the real API shapes it."""
        _validate(request)
        index = len(self.requests)
        self.requests.append(request)
        if index >= len(self.turns) and not self.repeat_last:
            raise ApiRefusal(f"the script has {len(self.turns)} turns; request {index + 1} is past its end")
        turn = self.turns[min(index, len(self.turns) - 1)]
        for check in turn.expect:
            complaint = check(request)
            if complaint:
                raise ApiRefusal(f"scripted turn {index + 1}: {complaint}")
        content = []
        for block in turn.content:
            block = dict(block)
            if block["type"] == "tool_use":
                block["id"] = f"toolu_{next(self._ids):04d}"
            content.append(block)
        uses_tool = any(block["type"] == "tool_use" for block in content)
        prompt_tokens = len(json.dumps(request)) // 4
        return {
            "id": f"msg_{next(self._ids):04d}",
            "type": "message",
            "role": "assistant",
            "model": request.get("model", self.model),
            "content": content,
            "stop_reason": "tool_use" if uses_tool else "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": max(1, len(json.dumps(content)) // 4),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }


def _validate(request: dict[str, Any]) -> None:
    """What the real API refuses, so the agent cannot pass tests it would fail against Claude."""
    for key in ("model", "max_tokens", "messages"):
        if key not in request:
            raise ApiRefusal(f"{key}: Field required")
    messages = request["messages"]
    if not messages or messages[0]["role"] != "user":
        raise ApiRefusal("messages: the first message must use the user role")
    for previous, current in itertools.pairwise(messages):
        if previous["role"] == current["role"]:
            raise ApiRefusal("messages: roles must alternate between user and assistant")
        if previous["role"] != "assistant" or not isinstance(previous["content"], list):
            continue
        asked = {block["id"] for block in previous["content"] if block.get("type") == "tool_use"}
        content = current["content"] if isinstance(current["content"], list) else []
        answered = {block.get("tool_use_id") for block in content if block.get("type") == "tool_result"}
        if asked - answered:
            raise ApiRefusal(
                f"tool_use ids were found without tool_result blocks immediately after: {sorted(asked - answered)}"
            )
        for block in content:
            for part in block.get("content") if isinstance(block.get("content"), list) else []:
                if part.get("type") == "image":
                    source = part.get("source", {})
                    if source.get("type") != "base64" or source.get("media_type") not in (
                        "image/png",
                        "image/jpeg",
                        "image/gif",
                        "image/webp",
                    ):
                        raise ApiRefusal("image source must be base64 PNG, JPEG, GIF or WebP")
    breakpoints = json.dumps(request).count('"cache_control"')
    if breakpoints > 4:
        raise ApiRefusal(f"a maximum of 4 blocks with cache_control may be provided; found {breakpoints}")


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class _MessagesHandler(web.RequestHandler):
    owner: ScriptedMessagesServer

    def initialize(self, owner: ScriptedMessagesServer) -> None:
        self.owner = owner

    def _refuse(self, refusal: ApiRefusal) -> None:
        self.set_status(refusal.status)
        self.set_header("Content-Type", "application/json")
        self.finish({"type": "error", "error": {"type": refusal.kind, "message": str(refusal)}})

    async def post(self) -> None:
        if not self.request.headers.get("x-api-key") and not self.request.headers.get("Authorization"):
            self._refuse(ApiRefusal("x-api-key header is required", 401, "authentication_error"))
            return
        try:
            request = json.loads(self.request.body)
            message = self.owner.reply_to(request)
        except ValueError as err:
            self._refuse(ApiRefusal(f"the body is not JSON: {err}"))
            return
        except ApiRefusal as refusal:
            log.warning("scripted Messages API refused a request: %s", refusal)
            self._refuse(refusal)
            return
        if not request.get("stream"):
            self.set_header("Content-Type", "application/json")
            self.finish(message)
            return
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        start = dict(message, content=[], stop_reason=None)
        start["usage"] = dict(message["usage"], output_tokens=1)
        self.write(_sse("message_start", {"type": "message_start", "message": start}))
        self.write(_sse("ping", {"type": "ping"}))
        for index, block in enumerate(message["content"]):
            if block["type"] == "text":
                opening, deltas = {"type": "text", "text": ""}, _chunks(block["text"], "text_delta", "text")
            else:
                opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                deltas = _chunks(json.dumps(block["input"]), "input_json_delta", "partial_json")
            self.write(
                _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
            )
            for delta in deltas:
                self.write(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            self.write(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
            await self.flush()
        self.write(
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                    "usage": {"output_tokens": message["usage"]["output_tokens"]},
                },
            )
        )
        self.write(_sse("message_stop", {"type": "message_stop"}))
        self.finish()


def _chunks(text: str, delta_type: str, field: str, size: int = 40) -> list[dict[str, Any]]:
    return [{"type": delta_type, field: text[i : i + size]} for i in range(0, len(text), size)] or [
        {"type": delta_type, field: ""}
    ]
