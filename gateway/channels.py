"""``/api/kernels/{id}/channels``: the Jupyter kernel websocket, relayed to the kernel's ZMQ sockets.

Each websocket gets its own shell/control/stdin DEALER sockets and an iopub SUB socket on the
kernel's ipc endpoints (no network involved). Client messages are re-signed with the kernel's
key; kernel messages are verified (HMAC) and re-framed before they reach the client, since
kernel output is untrusted. Frames that are not Jupyter messages are answered with an error
message on the websocket and dropped: one bad client never disturbs the kernel or others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import zmq
from jupyter_client.session import Session
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.base import ApiError
from sandkernel.gateway.registry import ManagedSession, SessionRegistry
from sandkernel.gateway.wire import FrameError, from_frame, to_frame
from tornado import websocket

log = logging.getLogger(__name__)

CLIENT_CHANNELS = ("shell", "control", "stdin")


class ChannelsHandler(websocket.WebSocketHandler):
    def initialize(self, registry: SessionRegistry, auth: TokenAuth | None, config: dict[str, Any]) -> None:
        self.registry = registry
        self.auth = auth
        self.config = config
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.tasks: list[asyncio.Task] = []
        self.managed: ManagedSession | None = None
        self.session: Session | None = None

    def check_origin(self, origin: str) -> bool:
        return True  # token auth, not cookies: cross-origin pages cannot present the token

    async def get(self, kernel_id: str, *args: Any, **kwargs: Any) -> None:
        tenant = "default"
        if self.auth is not None:
            tenant = self.auth.tenant_for(
                self.request.headers.get("Authorization"), self.get_query_argument("token", None)
            )
            if tenant is None:
                self.set_status(401)
                self.finish(json.dumps({"error": "unauthorized", "message": "missing or wrong token"}))
                return
        try:
            self.managed = self.registry.by_kernel(tenant, kernel_id)
        except LookupError:
            self.set_status(404)
            self.finish(json.dumps({"error": "not_found", "message": f"no kernel {kernel_id!r}"}))
            return
        await super().get(kernel_id, *args, **kwargs)

    def get_compression_options(self) -> None:
        return None

    def open(self, kernel_id: str) -> None:
        assert self.managed is not None
        self.set_nodelay(True)
        km = self.managed.session.kernel_manager
        self.session = km.session
        identity = (self.get_query_argument("session_id", "") or "").encode() or None
        self.sockets = {
            "shell": km.connect_shell(identity=identity),
            "control": km.connect_control(identity=identity),
            "stdin": km.connect_stdin(identity=identity),
            "iopub": km.connect_iopub(),
        }
        self.managed.connections += 1
        self.tasks = [asyncio.create_task(self._relay(name, sock)) for name, sock in self.sockets.items()]

    async def _relay(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        assert self.session is not None and self.managed is not None
        while True:
            parts = await sock.recv_multipart()
            try:
                _, msg_list = self.session.feed_identities(parts)
                msg = self.session.deserialize(msg_list)
            except (ValueError, KeyError, TypeError) as err:
                log.warning("dropped a kernel message that failed verification: %s", err)
                continue
            msg["channel"] = channel
            if channel == "iopub" and msg["header"]["msg_type"] == "status":
                self.managed.touch(msg["content"].get("execution_state"))
            try:
                await self.write_message(to_frame(msg), binary=bool(msg.get("buffers")))
            except websocket.WebSocketClosedError:
                return

    async def on_message(self, frame: str | bytes) -> None:
        assert self.session is not None
        try:
            msg = from_frame(frame)
        except FrameError as err:
            await self._complain(str(err))
            return
        channel = msg.pop("channel", None) or "shell"
        if channel not in CLIENT_CHANNELS:
            await self._complain(f"cannot send on channel {channel!r}; use shell, control or stdin")
            return
        buffers = msg.pop("buffers", [])
        self.session.send(self.sockets[channel], msg, buffers=buffers or None)

    async def _complain(self, message: str) -> None:
        with contextlib.suppress(websocket.WebSocketClosedError):
            await self.write_message(json.dumps({"channel": "gateway", "error": "bad_message", "message": message}))

    def on_close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for sock in self.sockets.values():
            sock.close(linger=0)
        if self.managed is not None:
            self.managed.connections = max(0, self.managed.connections - 1)


__all__ = ["ApiError", "ChannelsHandler"]
