"""``/api/kernels/{id}/channels``: the Jupyter kernel websocket, relayed to the kernel's ZMQ sockets.

Each websocket gets its own shell/control/stdin DEALER sockets and an iopub SUB socket on the
kernel's ipc endpoints (no network involved). Client messages are re-signed with the kernel's
key; kernel messages are verified (HMAC) and re-framed before they reach the client, since
kernel output is untrusted. Frames that are not Jupyter messages are answered with an error
message on the websocket and dropped: one bad client never disturbs the kernel or others.

Inbound traffic is bounded in bytes: a request counts as in flight from the moment it is sent to
the kernel until the kernel answers it (its reply, or its ``idle`` status). A connection, and a
tenant across all its connections, may have only so many bytes and requests in flight; past
that the websocket is closed with 1008 (policy violation) and a reason saying what to do, so a
client that sends faster than its kernel runs cannot queue gigabytes in the gateway. Other
tenants have their own budgets.

Executions are recorded in the session's transcript (an audit record): normal executes as cells,
and silent executes, ``user_expressions`` and debugger requests that run or change code as
notes, clipped to a bounded size.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import logging
import re
import time
import weakref
from typing import Any
from urllib.parse import urlparse

import zmq
from jupyter_client.session import Session
from tornado import websocket

from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.base import ApiError, authenticate_request
from sandkernel.gateway.registry import ManagedSession, SessionRegistry
from sandkernel.gateway.wire import FrameError, from_frame, to_frame
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus, OutputCollector, cut_marker
from sandkernel.kernels.execution.session import connect_iopub

log = logging.getLogger(__name__)

CLIENT_CHANNELS = ("shell", "control", "stdin")
# Each websocket holds four ZMQ sockets (file descriptors) in the gateway: bounded per kernel.
MAX_CONNECTIONS_PER_KERNEL = 16
NUDGE_TIMEOUT = 30.0
# How long a relay waits on its socket before polling it again (milliseconds); see _relay.
RELAY_POLL_MS = 500
IOPUB_RECOVERY_SECONDS = 10.0
# Bytes of client requests one websocket may have sent to its kernel and not yet had answered.
# A JupyterLab "run all" of a large notebook is a few MB; a client sending 16 MiB frames faster
# than the kernel runs them is refused at this bound (1008) instead of queueing in the gateway.
MAX_PENDING_BYTES_PER_CONNECTION = 32 * 1024 * 1024
# The same bound across all of one tenant's websocket connections (bytes): a tenant cannot
# multiply it by opening connections, and other tenants keep theirs.
MAX_PENDING_BYTES_PER_TENANT = 128 * 1024 * 1024
# Requests one websocket may have awaiting an answer: each pending execute keeps a small record
# for the transcript, so even tiny requests are bounded (a "run all" of 1000 cells fits).
MAX_PENDING_REQUESTS_PER_CONNECTION = 1024
# Characters of code (or debugger arguments) an audit note keeps; the rest is cut with a marker.
NOTE_CODE_CHARS = 4096
# Debugger commands recorded in the transcript: those that run code or change program state.
RECORDED_DEBUG_COMMANDS = frozenset(
    {"evaluate", "setExpression", "setVariable", "dumpCell", "copyToGlobals", "richInspectVariables"}
)
# WebSocket close code for a client over its in-flight budget (RFC 6455: policy violation).
CLOSE_POLICY_VIOLATION = 1008


class _TenantLedger:
    """Bytes in flight per tenant, across that tenant's websocket connections."""

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}

    def add(self, tenant: str, size: int) -> int:
        self.pending[tenant] = self.pending.get(tenant, 0) + size
        return self.pending[tenant]

    def release(self, tenant: str, size: int) -> None:
        left = self.pending.get(tenant, 0) - size
        if left > 0:
            self.pending[tenant] = left
        else:
            self.pending.pop(tenant, None)


# One ledger per gateway (its registry); the lead may move it into the server's settings.
_LEDGERS: weakref.WeakKeyDictionary[SessionRegistry, _TenantLedger] = weakref.WeakKeyDictionary()


def _ledger(registry: SessionRegistry) -> _TenantLedger:
    ledger = _LEDGERS.get(registry)
    if ledger is None:
        ledger = _LEDGERS[registry] = _TenantLedger()
    return ledger


def _clip_for_note(text: str) -> str:
    """At most NOTE_CODE_CHARS of ``text`` (head and tail), with the one cut marker and SHA-256."""
    if len(text) <= NOTE_CODE_CHARS:
        return text
    half = NOTE_CODE_CHARS // 2
    digest = hashlib.sha256(text.encode(errors="replace")).hexdigest()
    return text[:half] + cut_marker(len(text) - 2 * half, "characters", "code", sha256=digest) + text[-half:]


def _fenced(text: str, language: str = "") -> str:
    """A markdown code block that ``text`` cannot close early (fence longer than any backtick run)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"


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
            bytes_omitted=self.collector.bytes_omitted,
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
        self.tenant: str | None = None
        self.counted = False  # this handler holds one of the kernel's connection slots
        self.pending: dict[str, int] = {}  # msg_id -> bytes of client requests awaiting an answer
        self.pending_bytes = 0
        self.inputs_requested = 0  # input_requests relayed to this client and not yet answered
        self.refused = False  # closed over a budget: frames still arriving are ignored
        self.recording: dict[str, _Recording] = {}

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
        self.tenant = tenant
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
        # Our own copy: a Session rejects a signature it has seen, and every subscriber of the kernel
        # sees every broadcast message, so a shared one would drop them on all but the first.
        self.session = km.session.clone()
        identity = (self.get_query_argument("session_id", "") or "").encode() or None
        self.sockets = {
            "shell": km.connect_shell(identity=identity),
            "control": km.connect_control(identity=identity),
            "stdin": km.connect_stdin(identity=identity),
            "iopub": connect_iopub(km),
        }
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
            # Poll with a timeout rather than wait on recv alone: each poll ends in a real
            # zmq_poll, so a readiness edge lost between pyzmq and the event loop (seen as
            # websockets that never got their reply) costs at most RELAY_POLL_MS, never a hang.
            if not await sock.poll(RELAY_POLL_MS):
                continue
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
                state = msg["content"].get("execution_state")
                self.managed.touch(state)
                if state == "idle":
                    self._answered(parent_id)
                elif state in ("starting", "restarting", "dead"):  # no request survives a restart
                    self._forget_pending()
            elif channel in ("shell", "control") and parent_id in self.pending:
                self._answered(parent_id)
            elif channel == "stdin" and msg["header"]["msg_type"] == "input_request":
                self.inputs_requested += 1
            try:
                await self.write_message(to_frame(msg), binary=bool(msg.get("buffers")))
            except websocket.WebSocketClosedError:
                return
            if parent_id in self.recording:  # after forwarding: the transcript is off the hot path
                await self._record(parent_id, channel, msg)

    async def on_message(self, frame: str | bytes) -> None:
        assert self.session is not None
        await self.iopub_ready.wait()
        if self.refused:
            return
        try:
            msg = from_frame(frame)
        except FrameError as err:
            await self._complain(str(err))
            return
        channel = msg.pop("channel", None) or "shell"
        if channel not in CLIENT_CHANNELS:
            await self._complain(f"cannot send on channel {channel!r}; use shell, control or stdin")
            return
        msg_id = str(msg["header"].get("msg_id", ""))
        if channel == "stdin":  # stdin has no reply to wait for: only answers to input_requests pass
            if self.inputs_requested <= 0:
                await self._complain("no input was requested; stdin takes only an input_reply to an input_request")
                return
            self.inputs_requested -= 1
        elif not self._admit(msg_id, len(frame)):
            return
        buffers = msg.pop("buffers", [])
        content = msg.get("content") if isinstance(msg.get("content"), dict) else {}
        msg_type = msg["header"]["msg_type"]
        if channel == "shell" and msg_type == "execute_request":
            if not content.get("silent"):
                self.recording[msg_id] = _Recording(str(content.get("code", "")))
            await self._note_hidden_execute(content)
        elif channel == "control" and msg_type == "debug_request":
            await self._note_debug_request(content)
        self.session.send(self.sockets[channel], msg, buffers=buffers or None)

    def _admit(self, msg_id: str, size: int) -> bool:
        """Count a request as in flight, or close the websocket (1008) when it is over a budget."""
        assert self.tenant is not None
        ledger = _ledger(self.registry)
        reason = None
        if len(self.pending) >= MAX_PENDING_REQUESTS_PER_CONNECTION:
            reason = f"over {MAX_PENDING_REQUESTS_PER_CONNECTION} requests await the kernel; wait for replies"
        elif self.pending_bytes + size > MAX_PENDING_BYTES_PER_CONNECTION:
            reason = f"over {MAX_PENDING_BYTES_PER_CONNECTION >> 20} MiB of requests await the kernel; wait for replies"
        elif ledger.pending.get(self.tenant, 0) + size > MAX_PENDING_BYTES_PER_TENANT:
            reason = f"tenant has over {MAX_PENDING_BYTES_PER_TENANT >> 20} MiB of requests in flight; wait for replies"
        if reason is not None:
            log.warning("websocket closed: %s", reason, extra={"tenant": self.tenant})
            self.refused = True
            self.close(CLOSE_POLICY_VIOLATION, reason)
            return False
        size += self.pending.pop(msg_id, 0)  # a reused msg_id adds to the same entry
        self.pending[msg_id] = size
        self.pending_bytes += size
        ledger.add(self.tenant, size)
        return True

    def _answered(self, msg_id: str | None) -> None:
        size = self.pending.pop(msg_id, None) if msg_id else None
        if size is not None and self.tenant is not None:
            self.pending_bytes -= size
            _ledger(self.registry).release(self.tenant, size)

    def _forget_pending(self) -> None:
        """The kernel restarted: nothing in flight will be answered, and no recording will end."""
        for msg_id in list(self.pending):
            self._answered(msg_id)
        self.recording.clear()
        self.inputs_requested = 0

    async def _note(self, text: str) -> None:
        recorder = self.managed.session.recorder if self.managed else None
        if recorder is not None:
            await recorder.note(text)

    async def _note_hidden_execute(self, content: dict[str, Any]) -> None:
        """Silent executes and ``user_expressions`` leave no cell of their own: note them."""
        code = str(content.get("code", ""))
        expressions = content.get("user_expressions")
        if content.get("silent") and code.strip():
            await self._note(
                "a websocket client ran a silent execute (no outputs recorded):\n\n"
                + _fenced(_clip_for_note(code), "python")
            )
        if isinstance(expressions, dict) and expressions:
            listing = "\n".join(f"{name} = {value}" for name, value in expressions.items())
            await self._note(
                "a websocket client evaluated `user_expressions` with an execute:\n\n"
                + _fenced(_clip_for_note(listing), "python")
            )

    async def _note_debug_request(self, content: dict[str, Any]) -> None:
        """Debugger requests that run code or change state (evaluate, setVariable, ...)."""
        command = content.get("command")
        if command not in RECORDED_DEBUG_COMMANDS:
            return
        arguments = json.dumps(content.get("arguments", {}), ensure_ascii=False, default=str)
        await self._note(
            f"a websocket client sent the debugger `{command}`:\n\n" + _fenced(_clip_for_note(arguments), "json")
        )

    async def _record(self, msg_id: str, channel: str, msg: dict[str, Any]) -> None:
        """Build the transcript cell of a websocket execution from the traffic we relay."""
        recording = self.recording[msg_id]
        if channel == "shell" and msg["header"]["msg_type"] == "execute_reply":
            recording.reply_status = msg["content"].get("status")
            return
        if channel != "iopub":
            return
        if msg["header"]["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
            await self._finish_recording(msg_id)
            return
        if msg["header"]["msg_type"] == "status":  # busy: a new execution started, so earlier
            for other in [k for k, r in self.recording.items() if k != msg_id and r.reply_status]:
                await self._finish_recording(other)  # replied ones whose idle this subscriber lost are done
            return
        await recording.collector.add(msg)

    async def _finish_recording(self, msg_id: str) -> None:
        recording = self.recording.pop(msg_id)
        recorder = self.managed.session.recorder if self.managed else None
        if recorder is not None:
            await recorder.record(recording.code, recording.result(), source="websocket")

    async def _complain(self, message: str) -> None:
        with contextlib.suppress(websocket.WebSocketClosedError):
            await self.write_message(json.dumps({"channel": "gateway", "error": "bad_message", "message": message}))

    def on_close(self) -> None:
        self._forget_pending()
        for task in self.tasks:
            task.cancel()
        for sock in self.sockets.values():
            sock.close(linger=0)
        if self.managed is not None and self.counted:
            self.counted = False
            self.managed.connections = max(0, self.managed.connections - 1)


__all__ = ["ApiError", "ChannelsHandler"]
