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
import datetime as dt
import json
import logging
import time
from typing import Any
from urllib.parse import urlparse

import zmq
from jupyter_client.session import Session
from tornado import websocket

from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.base import ApiError, authenticate_request
from sandkernel.gateway.registry import ManagedSession, SessionRegistry
from sandkernel.gateway.wire import FrameError, from_frame, to_frame
from sandkernel.kernels.outputs import ExecutionResult, ExecutionStatus, OutputCollector

log = logging.getLogger(__name__)

CLIENT_CHANNELS = ("shell", "control", "stdin")
# Each websocket holds four ZMQ sockets (file descriptors) in the gateway: bounded per kernel.
MAX_CONNECTIONS_PER_KERNEL = 16
NUDGE_TIMEOUT = 30.0
IOPUB_RECOVERY_SECONDS = 10.0


class _Recording:
    """One execution seen on a websocket, collected into the shape the session layer uses."""

    def __init__(self, code: str) -> None:
        self.code = code
        self.collector = OutputCollector()
        self.started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")
        self.t0 = time.monotonic()
        self.reply_status: str | None = None

    def result(self) -> ExecutionResult:
        failed = self.collector.error is not None or self.reply_status == "error"
        return ExecutionResult(
            status=ExecutionStatus.ERROR if failed else ExecutionStatus.OK,
            outputs=self.collector.finished_outputs(),
            execution_count=self.collector.execution_count,
            started_at=self.started_at,
            duration=round(time.monotonic() - self.t0, 6),
            error=self.collector.error,
            chars_cut=self.collector.chars_cut,
            outputs_dropped=self.collector.outputs_dropped,
        )


class ChannelsHandler(websocket.WebSocketHandler):
    def initialize(self, registry: SessionRegistry, auth: TokenAuth | None, config: dict[str, Any]) -> None:
        self.registry = registry
        self.auth = auth
        self.config = config
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.tasks: list[asyncio.Task] = []
        self.managed: ManagedSession | None = None
        self.session: Session | None = None
        self.counted = False  # this handler holds one of the kernel's connection slots

    def check_origin(self, origin: str) -> bool:
        """Browsers send Origin; a page of another site may open a websocket to us. Allowed:
        the gateway's own origin and those the operator lists (``--allow-origin``). Clients
        that send no Origin (SDKs, jupyter_server) are not browsers and pass."""
        allowed = self.config.get("allow_origins") or ()
        if "*" in allowed or origin in allowed:
            return True
        return urlparse(origin).netloc.lower() == (self.request.headers.get("Host") or "").lower()

    def _refuse(self, status: int, code: str, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": code, "message": message}))

    async def get(self, kernel_id: str, *args: Any, **kwargs: Any) -> None:
        try:
            tenant = authenticate_request(self, self.auth)
        except ApiError as err:
            self._refuse(err.status_code, err.code, err.message)
            return
        try:
            self.managed = self.registry.by_kernel(tenant, kernel_id)
        except LookupError:
            self._refuse(404, "not_found", f"no kernel {kernel_id!r}")
            return
        per_kernel = self.config.get("max_connections_per_kernel", MAX_CONNECTIONS_PER_KERNEL)
        if self.managed.connections >= per_kernel:
            self._refuse(
                429,
                "too_many_connections",
                f"kernel {kernel_id} already has {per_kernel} websocket connections; close one first",
            )
            return
        origin = self.request.headers.get("Origin")
        if origin and not self.check_origin(origin):
            self._refuse(
                403,
                "forbidden_origin",
                f"websocket from origin {origin!r} refused; the operator can allow it with --allow-origin",
            )
            return
        self.managed.connections += 1  # counted from the handshake, so a burst cannot overshoot
        self.counted = True
        try:
            await super().get(kernel_id, *args, **kwargs)
        finally:
            if self.ws_connection is None and self.counted:  # the upgrade failed: give the slot back
                self.counted = False
                self.managed.connections = max(0, self.managed.connections - 1)

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
        self.recording: dict[str, _Recording] = {}
        self.iopub_ready = asyncio.Event()
        self.nudge_ids: set[str] = set()
        self.tasks = [asyncio.create_task(self._relay(name, sock)) for name, sock in self.sockets.items()]
        self.tasks.append(asyncio.create_task(self._nudge()))
        self.tasks.append(asyncio.create_task(self._watch_iopub(self.sockets["iopub"])))

    async def _nudge(self, timeout: float = NUDGE_TIMEOUT) -> bool:
        """Hold client messages until our iopub subscription is live; True when it is.

        A SUB socket joins late: without this, outputs of the first request (its ``idle``
        status above all) can be lost and the client waits forever. We send kernel_info
        requests until one's iopub status arrives; their replies are not forwarded.
        """
        assert self.session is not None
        self.iopub_ready.clear()
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.iopub_ready.is_set() and asyncio.get_running_loop().time() < deadline:
            msg = self.session.msg("kernel_info_request")
            self.nudge_ids.add(msg["header"]["msg_id"])
            self.session.send(self.sockets["shell"], msg)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.iopub_ready.wait(), 0.25)
        live = self.iopub_ready.is_set()
        self.iopub_ready.set()  # give up waiting: better late outputs than a dead socket
        return live

    async def _watch_iopub(self, sock: zmq.asyncio.Socket) -> None:
        """ZMQ cuts a subscriber that receives a message over the size cap and never restores
        it. After a disconnect (also seen on kernel restarts, which recover by themselves) the
        subscription is probed; if it stays dead the websocket is closed so the client
        reconnects (JupyterLab does) with a fresh one, instead of silently getting no output."""
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                if not await self._nudge(IOPUB_RECOVERY_SECONDS):
                    break
        finally:
            with contextlib.suppress(zmq.ZMQError):  # the websocket may have closed the socket
                sock.disable_monitor()
            monitor.close(linger=0)
        log.warning("kernel output channel lost (oversized message?); closing the websocket")
        self.close(1011, "kernel output channel lost; reconnect")

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
            parent_id = msg.get("parent_header", {}).get("msg_id")
            if parent_id in self.nudge_ids:
                if channel == "iopub":
                    self.iopub_ready.set()
                continue
            msg["channel"] = channel
            if channel == "iopub" and msg["header"]["msg_type"] == "status":
                self.managed.touch(msg["content"].get("execution_state"))
            try:
                await self.write_message(to_frame(msg), binary=bool(msg.get("buffers")))
            except websocket.WebSocketClosedError:
                return
            if parent_id in self.recording:  # after forwarding: the transcript is off the hot path
                await self._record(parent_id, channel, msg)

    async def on_message(self, frame: str | bytes) -> None:
        assert self.session is not None
        await self.iopub_ready.wait()
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
        content = msg.get("content") or {}
        if channel == "shell" and msg["header"]["msg_type"] == "execute_request" and not content.get("silent"):
            self.recording[msg["header"].get("msg_id", "")] = _Recording(str(content.get("code", "")))
        self.session.send(self.sockets[channel], msg, buffers=buffers or None)

    async def _record(self, msg_id: str, channel: str, msg: dict[str, Any]) -> None:
        """Build the transcript cell of a websocket execution from the traffic we relay."""
        recording = self.recording[msg_id]
        if channel == "shell" and msg["header"]["msg_type"] == "execute_reply":
            recording.reply_status = msg["content"].get("status")
            return
        if channel != "iopub":
            return
        if msg["header"]["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
            del self.recording[msg_id]
            recorder = self.managed.session.recorder if self.managed else None
            if recorder is not None:
                await recorder.record(recording.code, recording.result(), source="websocket")
            return
        await recording.collector.add(msg)

    async def _complain(self, message: str) -> None:
        with contextlib.suppress(websocket.WebSocketClosedError):
            await self.write_message(json.dumps({"channel": "gateway", "error": "bad_message", "message": message}))

    def on_close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for sock in self.sockets.values():
            sock.close(linger=0)
        if self.managed is not None and self.counted:
            self.counted = False
            self.managed.connections = max(0, self.managed.connections - 1)


__all__ = ["ApiError", "ChannelsHandler"]
