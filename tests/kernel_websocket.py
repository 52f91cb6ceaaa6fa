"""Running a cell over a Jupyter kernel websocket (``/api/kernels/{id}/channels``), for the
tests that drive a kernel the way JupyterLab does, through whichever gateway they are testing."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from tornado.websocket import WebSocketClientConnection


def execute_request(msg_id: str, code: str) -> dict[str, Any]:
    """A Jupyter ``execute_request`` on the shell channel, as a websocket client sends it."""
    header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "t", "session": "s", "date": "",
              "version": "5.3"}  # fmt: skip
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False}
    return {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": "shell"}


async def run_cell(ws: WebSocketClientConnection, code: str, msg_id: str | None = None) -> tuple[dict[str, Any], str]:
    """(the execute_reply's content, the stream text) of one cell run over a kernel websocket.
    With ``msg_id`` the request was sent already: only its replies are read."""
    if msg_id is None:
        msg_id = uuid.uuid4().hex
        await ws.write_message(json.dumps(execute_request(msg_id, code)))
    texts: list[str] = []
    reply: dict[str, Any] | None = None
    idle = False
    while reply is None or not idle:  # the reply (shell) and idle (iopub) come in either order
        message = await asyncio.wait_for(ws.read_message(), 60)
        assert message is not None, f"the websocket closed: {ws.close_code} {ws.close_reason}"
        msg = json.loads(message)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            texts.append(msg["content"]["text"])
        elif msg["msg_type"] == "execute_reply":
            reply = msg["content"]
        elif msg["msg_type"] == "status":
            idle = msg["content"]["execution_state"] == "idle"
    return reply, "".join(texts)


async def wait_for_stream(ws: WebSocketClientConnection, msg_id: str, text: str, timeout: float = 120) -> None:
    """Read until cell ``msg_id`` printed ``text``: its code is running. (An interrupt sent when the
    kernel only said busy can land before ipykernel takes SIGINT for the cell, and is ignored.)"""
    seen = ""
    async with asyncio.timeout(timeout):
        while text not in seen:
            message = await ws.read_message()
            assert message is not None, f"the websocket closed: {ws.close_code} {ws.close_reason}"
            msg = json.loads(message)
            if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "stream":
                seen += msg["content"]["text"]
