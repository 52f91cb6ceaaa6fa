"""``/api/kernels/{id}/channels``: the Jupyter kernel websocket, relayed to the kernel's ZMQ sockets.

Each websocket gets its own shell/control/stdin DEALER sockets and an iopub SUB socket on the
kernel's ipc endpoints (no network involved). Client messages are re-signed with the kernel's
key; kernel messages are verified (HMAC) and re-framed before they reach the client, since
kernel output is untrusted. Frames that are not Jupyter messages are answered with an error
message on the websocket and dropped: one bad client never disturbs the kernel or others.

Every message passes through unchanged (debugger, comms, widgets, stdin), but an
``execute_request`` runs on the session's one execution path (``KernelSession.execute_relayed``):
queued behind other doors' executions, under the operator's timeout ladder, with death and OOM
classification, output budgets, metrics and the transcript, exactly as a session-API execute.
To keep the kernel's order, this connection's shell requests are sent one after another: a
request waits while an execute before it runs (as it would in the kernel's own queue). When an
execute fails with ``stop_on_error`` (JupyterLab's default) or its kernel restarts, the execute
requests queued behind it are answered ``aborted``, as the kernel itself would. An execute the
operator's execution policy (or a quarantined session's breaker) refuses never reaches the kernel;
it is answered here as a kernel answers code that raised, with the refusal's message as the error.

Inbound bytes are bounded (inflight.py); hidden code (silent executes, ``user_expressions``,
debugger requests that run code) is noted in the record (ws_audit.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

import zmq
from jupyter_client.session import Session
from tornado import websocket

from sandkernel import doors
from sandkernel.errors import SandkernelError
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.base import (
    ForwardedRequest,
    OtherHost,
    authenticate_request,
    error_reply,
    restarting_error,
    retry_after_of,
)
from sandkernel.gateway.http_api import ApiError
from sandkernel.gateway.inflight import InFlight, ledger_of
from sandkernel.gateway.managed import ManagedSession
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.service import SessionService
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.traffic import Traffic
from sandkernel.gateway.wire import FrameError, from_frame, to_frame
from sandkernel.gateway.ws_audit import debug_request_note, execute_request_notes
from sandkernel.kernels.execution.outputs import REFUSED_ENAME, ExecutionResult, ExecutionStatus, TimeoutStep
from sandkernel.kernels.execution.replies import RelayedReply
from sandkernel.kernels.execution.transport import connect_iopub
from sandkernel.logs import Throttle

if TYPE_CHECKING:
    from tornado.httputil import HTTPServerRequest

log = logging.getLogger(__name__)

CLIENT_CHANNELS = ("shell", "control", "stdin")
NUDGE_TIMEOUT = 30.0
# How long a relay waits on its socket before polling it again (milliseconds); see _relay.
RELAY_POLL_MS = 500
RELAY_BATCH = 64  # messages relayed per poll, at most (each followed by a yield to the loop)
IOPUB_RECOVERY_SECONDS = 10.0
# WebSocket close code for a client over its in-flight budget (RFC 6455: policy violation).
CLOSE_POLICY_VIOLATION = 1008
# Executions whose websocket closed while they ran: they finish (and are recorded) on their own.
_ORPHANED: set[asyncio.Task] = set()


class Upstream(Protocol):
    """The owner host's websocket a client's is relayed to (gateway/cluster/forward.py's
    ForwardedChannels): frames pass through both ways, a close closes the other side."""

    def start(self) -> None: ...

    async def to_owner(self, message: str | bytes) -> None: ...

    def close(self, code: int | None, reason: str | None) -> None: ...


class WebsocketRouter(Protocol):
    """What a kernel websocket asks of the cluster's router at its handshake
    (gateway/cluster/router.py's ClusterRouter; this module imports nothing of gateway/cluster)."""

    def forwarded_from(self, request: HTTPServerRequest) -> ForwardedRequest | None: ...

    async def websocket_owner(self, tenant: str, kernel_id: str) -> OtherHost | None: ...

    async def relay_websocket(self, handler: Any, host: Any) -> Upstream | tuple[int, bytes]: ...


def _orphan_done(task: asyncio.Task) -> None:
    _ORPHANED.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("an execution whose websocket closed failed: %r", task.exception())


def _aborts_queue(result: ExecutionResult, content: dict[str, Any]) -> bool:
    """Whether the execute requests queued behind this one are answered ``aborted``: the kernel
    aborts its queue after a failed non-silent execute with ``stop_on_error`` (the default), and
    a restart loses it whatever the request said."""
    if result.status in (ExecutionStatus.KERNEL_DIED, ExecutionStatus.OOM, ExecutionStatus.RESTARTED):
        return True
    if result.ended_by in (TimeoutStep.RESTART, TimeoutStep.KILL):
        return True
    failed = result.status is not ExecutionStatus.OK
    return failed and not content.get("silent") and content.get("stop_on_error", True) is not False


class ChannelsHandler(websocket.WebSocketHandler):
    def initialize(
        self,
        registry: SessionRegistry,
        auth: TokenAuth | None,
        settings: GatewaySettings,
        service: SessionService,
        traffic: Traffic,
        router: WebsocketRouter | None = None,
    ) -> None:
        self.registry = registry
        self.router = router  # the cluster's (None on a single host): where this kernel is served
        self.service = service
        self.traffic = traffic  # this websocket registers there while open (closed 1012 on a restart)
        self.auth = auth
        self.gateway_settings = settings
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.tasks: list[asyncio.Task] = []
        self.managed: ManagedSession | None = None
        self.session: Session | None = None
        self.tenant: str | None = None
        self.counted = False  # this handler holds one of the kernel's connection slots
        self.inflight: InFlight | None = None
        self.inputs_requested = 0  # input_requests relayed to this client and not yet answered
        self.dropped = Throttle()  # the warnings for messages that failed verification
        self.refused = False  # closed over a budget: frames still arriving are ignored
        self.shell_queue: asyncio.Queue[tuple[dict[str, Any], list[Any]]] = asyncio.Queue()
        self.replies: dict[str, RelayedReply] = {}  # execute replies the session layer waits for
        self.upstream: Upstream | None = None  # cluster mode: the owner host's websocket
        self.forwarded_from: str | None = None  # the origin host of a websocket another gateway forwarded

    def check_origin(self, origin: str) -> bool:
        """Browsers send Origin; a page of another site may open a websocket to us. Allowed:
        the gateway's own origin and those the operator lists (``--allow-origin``). Clients
        that send no Origin (SDKs, jupyter_server) are not browsers and pass."""
        allowed = self.gateway_settings.allow_origins
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
            self._refuse(*error_reply(err))
            return
        self.tenant = tenant
        if self.registry.stopping:  # the next gateway process will serve this kernel
            self._refuse(*error_reply(restarting_error()))
            return
        router = self.router
        try:  # a request another gateway of the cluster forwarded: never forwarded again
            forwarded = router.forwarded_from(self.request) if router is not None else None
            if forwarded is not None:
                forwarded.check_body(b"")  # a websocket's request has none
                self.forwarded_from = forwarded.origin
        except ApiError as err:  # a bad, stale or replayed signature
            self._refuse(*error_reply(err))
            return
        try:
            self.managed = self.registry.by_kernel(tenant, kernel_id)
        except LookupError:
            if await self._forwarded(tenant, kernel_id, *args, **kwargs):
                return
            self._refuse(404, "not_found", f"no kernel {kernel_id!r}")
            return
        per_kernel = self.gateway_settings.max_connections_per_kernel
        if self.managed.connections >= per_kernel:
            self._refuse(
                429,
                "too_many_connections",
                f"kernel {kernel_id} already has {per_kernel} websocket connections; close one first",
            )
            return
        if self._origin_refused():
            return
        self.managed.connections += 1  # counted from the handshake, so a burst cannot overshoot
        self.counted = True
        try:
            await super().get(kernel_id, *args, **kwargs)
        finally:
            if self.ws_connection is None and self.counted:  # the upgrade failed: give the slot back
                self.counted = False
                self.managed.connections = max(0, self.managed.connections - 1)

    def _origin_refused(self) -> bool:
        """Refuse (403) a browser's websocket from an origin not allowed (see check_origin)."""
        origin = self.request.headers.get("Origin")
        if origin and not self.check_origin(origin):
            self._refuse(
                403,
                "forbidden_origin",
                f"websocket from origin {origin!r} refused; the operator can allow it with --allow-origin",
            )
            return True
        return False

    async def _forwarded(self, tenant: str, kernel_id: str, *args: Any, **kwargs: Any) -> bool:
        """Cluster mode: relay the websocket to the host holding the tenant's kernel, when that
        is another host (True: this request is answered). A request another gateway forwarded
        is never forwarded again (a bad signature on it is a 401)."""
        router = self.router
        if router is None or self.forwarded_from is not None:
            return False
        try:
            host = await router.websocket_owner(tenant, kernel_id)
            if host is None:
                return False
            if self._origin_refused():  # checked here: the owner would compare it with its own Host
                return True
            upstream = await router.relay_websocket(self, host)
        except (ApiError, SandkernelError) as err:
            retry = retry_after_of(err)
            if retry is not None:
                self.set_header("Retry-After", str(retry))
            self._refuse(*error_reply(err))
            return True
        if isinstance(upstream, tuple):  # the owner refused: its answer, as it gave it
            status, body = upstream
            self.set_status(status)
            self.set_header("Content-Type", "application/json")
            self.finish(body)
            return True
        self.upstream = upstream
        try:
            await super().get(kernel_id, *args, **kwargs)
        finally:
            if self.ws_connection is None:  # the client's upgrade failed: let the owner's side go
                upstream.close(None, None)
        return True

    def get_compression_options(self) -> None:
        return None

    def open(self, kernel_id: str) -> None:
        self.set_nodelay(True)
        if self.upstream is not None:
            self.upstream.start()
            self.traffic.websockets.add(self)  # closed with 1012 when this gateway restarts
            return
        assert self.managed is not None and self.tenant is not None
        km = self.managed.session.kernel_manager
        # Our own copy: a Session rejects a signature it has seen, and every subscriber of the kernel
        # sees every broadcast message, so a shared one would drop them on all but the first.
        self.session = km.session.clone()
        self.inflight = InFlight(self.tenant, ledger_of(self.registry))
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
        self.tasks.append(asyncio.create_task(self._send_shell()))
        self.traffic.websockets.add(self)  # closed with 1012 when the gateway restarts
        self.deliver_settled_replies()

    def deliver_settled_replies(self) -> None:
        """Send the replies of executes cut off from their client by a gateway restart (see
        settled_replies.py); the first websocket of the kernel to get them takes them."""
        assert self.managed is not None
        pending, self.managed.settled_replies = self.managed.settled_replies, []
        for message in pending:
            with contextlib.suppress(websocket.WebSocketClosedError):
                self.write_message(to_frame(message))

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
        reconnects (JupyterLab does) with a fresh one, instead of silently getting no output.

        A save of the kernel's memory (a fork's parent, a cell's checkpoint) detaches its sockets
        until it ends: the probe starts after it (a loaded host's fork took longer than the
        probe's bound, and the websocket was closed under JupyterLab for nothing)."""
        assert self.managed is not None
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                await monitor.recv_multipart()
                await self.managed.session.until_saved()
                if not await self._nudge(IOPUB_RECOVERY_SECONDS):
                    break
        finally:
            with contextlib.suppress(zmq.ZMQError):  # the websocket may have closed the socket
                sock.disable_monitor()
            monitor.close(linger=0)
        log.warning("kernel output channel lost (oversized message?); closing the websocket")
        self.close(1011, "kernel output channel lost; reconnect")

    async def _relay(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            # Poll with a timeout rather than wait on recv alone: each poll ends in a real
            # zmq_poll, so a readiness edge lost between pyzmq and the event loop (seen as
            # websockets that never got their reply) costs at most RELAY_POLL_MS, never a hang.
            if not await sock.poll(RELAY_POLL_MS):
                continue
            # Then take what is already queued (a burst of output) without another poll, at most
            # RELAY_BATCH, yielding to the loop after each: a DONTWAIT receive is complete at once
            # and a message dropped on verification awaits nothing, so a kernel flooding junk
            # would otherwise hold the gateway's loop. EVENTS is checked first so no zmq.Again is
            # raised (see drain.py: a raised exception's cycle holds the frames until a collection).
            for _ in range(RELAY_BATCH):
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                parts = sock.recv_multipart(flags=zmq.DONTWAIT).result()
                if not await self._forward(channel, parts):
                    return
                await asyncio.sleep(0)

    async def _forward(self, channel: str, parts: list[bytes]) -> bool:
        """Verify one kernel message and send it to the client; False once the websocket closed."""
        assert self.session is not None and self.managed is not None and self.inflight is not None
        try:
            _, msg_list = self.session.feed_identities(parts)
            msg = self.session.deserialize(msg_list)
        except (ValueError, KeyError, TypeError) as err:
            if (skipped := self.dropped.allow()) is not None:
                log.warning("dropped a kernel message that failed verification: %s (%d more not logged)", err, skipped)
            return True
        parent_id = msg.get("parent_header", {}).get("msg_id")
        if parent_id in self.nudge_ids:
            if channel == "iopub":
                self.iopub_ready.set()
            return True
        msg["channel"] = channel
        msg_type = msg["header"]["msg_type"]
        if channel == "iopub" and msg_type == "status":
            state = msg["content"].get("execution_state")
            self.managed.touch(state)
            if state == "idle":
                self.inflight.answered(parent_id)
            elif state in ("starting", "restarting", "dead"):  # no request survives a restart
                self.inflight.forget_all()
                self.inputs_requested = 0
        elif channel in ("shell", "control"):
            self.inflight.answered(parent_id)
            if msg_type == "execute_reply" and parent_id in self.replies:
                self.replies[parent_id].deliver(msg["content"])
        elif channel == "stdin" and msg_type == "input_request":
            self.inputs_requested += 1
        try:
            await self.write_message(to_frame(msg), binary=bool(msg.get("buffers")))
        except websocket.WebSocketClosedError:
            return False
        return True

    async def on_message(self, frame: str | bytes) -> None:
        if self.upstream is not None:
            await self.upstream.to_owner(frame)
            return
        assert self.session is not None and self.managed is not None
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
        msg_type = msg["header"]["msg_type"]
        content = msg.get("content") if isinstance(msg.get("content"), dict) else {}
        if msg_type == "execute_request" and not isinstance(content.get("code", ""), str):
            await self._complain("execute_request content.code must be a string of source code")
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
        if channel == "shell":
            self.shell_queue.put_nowait((msg, buffers))  # bounded by the in-flight budget above
            return
        if channel == "control" and msg_type == "interrupt_request":
            self.managed.session.expect_interrupt()
        elif channel == "control" and msg_type == "debug_request":
            note = debug_request_note(content)
            if note is not None:
                await self.managed.session.note(note)
        self.session.send(self.sockets[channel], msg, buffers=buffers or None)

    async def _send_shell(self) -> None:
        """Send this connection's shell requests in order, executes through the session's path."""
        assert self.session is not None
        while True:
            msg, buffers = await self.shell_queue.get()
            if msg["header"]["msg_type"] != "execute_request":
                self.session.send(self.sockets["shell"], msg, buffers=buffers or None)
                continue
            content = msg.get("content") if isinstance(msg.get("content"), dict) else {}
            if self.registry.stopping:  # not sent: the client re-runs it on the next gateway
                await self._complain(f"execute_request not run: {restarting_error().message}")
                self._answer_aborted(msg)
                continue
            result = await self._run_relayed(msg, buffers, content)
            if result is not None and result.status is ExecutionStatus.REFUSED:
                self._answer_refused(msg, result)
            if result is not None and _aborts_queue(result, content):
                await self._abort_queued_executes()

    async def _run_relayed(
        self, msg: dict[str, Any], buffers: list[Any], content: dict[str, Any]
    ) -> ExecutionResult | None:
        """Run one relayed execute_request on the session's execution path; None if it could not run."""
        assert self.session is not None and self.managed is not None
        managed = self.managed
        session = managed.session
        msg_id = str(msg["header"].get("msg_id", ""))
        reply = self.replies[msg_id] = RelayedReply()

        sent = False

        def send() -> str:
            nonlocal sent
            assert self.session is not None
            self.session.send(self.sockets["shell"], msg, buffers=buffers or None)
            sent = True
            return msg_id

        try:
            for note in execute_request_notes(content):
                await session.note(note)
            task = asyncio.create_task(
                self.service.execute_relayed(
                    managed, doors.WEBSOCKET, content.get("code", ""), send, reply, bool(content.get("silent"))
                )
            )
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:  # the websocket closed
                if sent:  # the kernel runs it: let it finish, be recorded and keep its turn
                    _ORPHANED.add(task)
                    task.add_done_callback(_orphan_done)
                else:  # still waiting for its turn: withdrawn, the kernel never sees it
                    task.cancel()
                raise
        except SandkernelError as err:  # the session closed under us: say so, the kernel never saw it
            await self._complain(f"execute_request not run: {err}")
            self._answer_aborted(msg)
            return None
        finally:
            self.replies.pop(msg_id, None)

    async def _abort_queued_executes(self) -> None:
        """Answer the execute requests queued behind a failed one ``aborted``; keep the rest in order."""
        kept = []
        while not self.shell_queue.empty():
            msg, buffers = self.shell_queue.get_nowait()
            if msg["header"]["msg_type"] == "execute_request":
                self._answer_aborted(msg)
            else:
                kept.append((msg, buffers))
        for item in kept:
            self.shell_queue.put_nowait(item)

    def _answer_aborted(self, request: dict[str, Any]) -> None:
        """What the kernel sends for an execute it aborts: busy, an ``aborted`` reply, idle."""
        self._answer(request["header"], [("shell", "execute_reply", {"status": "aborted"})])

    def _answer(self, parent: dict[str, Any], middle: list[tuple[str, str, dict[str, Any]]]) -> None:
        """Answer a request the kernel never saw, as the kernel would: busy, ``middle`` (channel,
        msg_type, content), idle; the request is no longer in flight."""
        assert self.session is not None and self.inflight is not None
        busy = [("iopub", "status", {"execution_state": "busy"})]
        idle = [("iopub", "status", {"execution_state": "idle"})]
        self.inflight.answered(str(parent.get("msg_id", "")))
        for channel, msg_type, content in busy + middle + idle:
            message = self.session.msg(msg_type, content, parent=parent)
            message["channel"] = channel
            with contextlib.suppress(websocket.WebSocketClosedError):
                self.write_message(to_frame(message))

    def _answer_refused(self, request: dict[str, Any], result: ExecutionResult) -> None:
        """What a kernel sends for code that raised at once, for an execute a gate refused (it was
        never sent, so the kernel says nothing): busy, the ``error`` output, an ``error`` reply
        with its ename/evalue/traceback, idle. Clients and JupyterLab show the refusal's message
        where a traceback goes; the refusal itself was recorded by the session's observers."""
        parent = request["header"]
        error = next((o for o in result.outputs if o.get("output_type") == "error"), None) or {
            "ename": REFUSED_ENAME,
            "evalue": str((result.refusal or {}).get("message", "refused")),
            "traceback": [],
        }
        fields = {key: error.get(key) for key in ("ename", "evalue", "traceback")}
        reply = {"status": "error", "execution_count": None, "user_expressions": {}, "payload": [], **fields}
        self._answer(parent, [("iopub", "error", fields), ("shell", "execute_reply", reply)])

    def _admit(self, msg_id: str, size: int) -> bool:
        """Count a request as in flight, or close the websocket (1008) when it is over a budget."""
        assert self.inflight is not None
        reason = self.inflight.admit(msg_id, size)
        if reason is None:
            return True
        log.warning("websocket closed: %s", reason, extra={"tenant": self.tenant})
        self.refused = True
        self.close(CLOSE_POLICY_VIOLATION, reason)
        return False

    async def _complain(self, message: str) -> None:
        with contextlib.suppress(websocket.WebSocketClosedError):
            await self.write_message(json.dumps({"channel": "gateway", "error": "bad_message", "message": message}))

    def on_close(self) -> None:
        if self.upstream is not None:
            self.upstream.close(self.close_code, self.close_reason)
        self.traffic.websockets.discard(self)
        if self.inflight is not None:
            self.inflight.forget_all()
        for reply in self.replies.values():
            reply.abandon()  # its socket closes: the running execution ends by iopub alone
        for task in self.tasks:
            task.cancel()
        for sock in self.sockets.values():
            sock.close(linger=0)
        if self.managed is not None and self.counted:
            self.counted = False
            self.managed.connections = max(0, self.managed.connections - 1)


__all__ = ["ApiError", "ChannelsHandler"]
