"""MCP over streamable HTTP at ``/mcp``: the SDK's session manager behind a tornado handler.

The MCP server (tools.py) is served by the official SDK's ``StreamableHTTPSessionManager``, an
ASGI app; :class:`McpHandler` bridges one tornado request to it: it builds the ASGI scope from the
request, hands it the body, and streams the ASGI response back (SSE events are flushed as they
come), telling the app when the client goes away. The SDK runs on anyio over asyncio, which is
tornado's own loop: no thread, nothing blocking.

Before the SDK sees anything, the gateway's own checks run (base.py's ``BaseHandler``): the token
(401, and the failed-auth limiter's 429), the 503 while stopping, and a body limit
(:data:`MAX_MCP_BODY_BYTES`, a 413). The tenant goes into the scope (http_sessions.py), so the
SDK serves a legacy MCP session only to the tenant that opened it and each tool call acts only on
its caller's sessions.

:class:`McpHttp` owns the manager's ``run()`` context (in a task of its own: anyio scopes must
be entered and left in one task) for the gateway's lifetime, and the sweeper that ends idle
legacy MCP sessions. The ``mcp`` package is an optional extra: without it :meth:`McpHttp.start`
returns None and ``/mcp`` is not routed (a 404 that names the API document).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from tornado.iostream import StreamClosedError

from sandkernel.gateway.base import BaseHandler, OtherHost, Router
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.service import SessionService
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.traffic import Traffic

if TYPE_CHECKING:
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from sandkernel.gateway.auth import TokenAuth
    from sandkernel.gateway.mcp.http_sessions import HttpSessions

log = logging.getLogger(__name__)

MCP_PATH = "/mcp"
MAX_SESSION_ID_CHARS = 64  # a longer "session id" is nobody's: not looked up in the catalog
# Request bodies larger than this get a 413 before the SDK parses them (on the event loop): the
# SDK's own default, far above any tool call's code or arguments.
MAX_MCP_BODY_BYTES = 4 * 1024 * 1024
# Seconds the SDK gets to end its sessions when the gateway stops.
STOP_SECONDS = 10.0
# How long a legacy MCP session may be idle when the operator turned idle culling off (seconds):
# the SDK's own default. Its default sandbox session is deleted with it.
DEFAULT_MCP_IDLE_SECONDS = 30 * 60.0

Message = dict[str, Any]


class McpHttp:
    """The ``/mcp`` door of one gateway: the SDK's session manager, run from :meth:`start` to
    :meth:`stop`, and the HTTP sessions' bookkeeping (http_sessions.py)."""

    def __init__(self, manager: StreamableHTTPSessionManager, sessions: HttpSessions, interval: float) -> None:
        self.manager = manager
        self.sessions = sessions
        self._stop = asyncio.Event()
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run())
        self._sweeper: asyncio.Task[None] | None = None
        self._interval = interval
        sessions.terminate = self._terminate

    @classmethod
    async def start(
        cls, registry: SessionRegistry, settings: GatewaySettings, service: SessionService
    ) -> McpHttp | None:
        """Build the MCP server over ``registry`` and start serving it; None (logged) when the
        optional ``mcp`` package is not installed."""
        try:
            from mcp.server.transport_security import TransportSecuritySettings

            from sandkernel.gateway.mcp.http_sessions import HttpSessions, note_started_sessions
            from sandkernel.gateway.mcp.tools import build_mcp_server
        except ImportError as missing:
            log.info("MCP over HTTP is off (%s): install sandkernel[mcp] for /mcp", missing)
            return None

        idle = settings.idle_timeout if settings.idle_timeout is not None else DEFAULT_MCP_IDLE_SECONDS
        sessions = HttpSessions(registry, idle)
        server = build_mcp_server(sessions.resolver_for, service)
        server.middleware.append(note_started_sessions)
        server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            max_request_body_size=MAX_MCP_BODY_BYTES,
            session_idle_timeout=None,  # the gateway keeps that clock (http_sessions.py)
            # Every request carries a gateway token, which a rebinding page does not have: Host
            # and Origin checks would only refuse clients that name the gateway another way.
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        door = cls(server.session_manager, sessions, settings.cull_interval)
        await door._started
        door._sweeper = asyncio.create_task(door._sweep_forever())
        log.info("MCP over streamable HTTP at %s", MCP_PATH)
        return door

    async def _run(self) -> None:
        try:
            async with self.manager.run():
                self._started.set_result(None)
                await self._stop.wait()
        except BaseException as err:
            if not self._started.done():
                self._started.set_exception(err)
            raise

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.sessions.sweep()
            except Exception:  # one failed sweep must not stop the next
                log.exception("sweeping idle MCP sessions failed")

    async def serve(self, scope: Message, receive: Any, send: Any) -> None:
        """Hand one request to the SDK."""
        await self.manager.handle_request(scope, receive, send)

    async def _terminate(self, tenant: str, mcp_session: str) -> None:
        """End a legacy MCP session in the SDK as its client would: a DELETE with its id."""
        from sandkernel.gateway.mcp.http_sessions import MCP_SESSION_HEADER, scope_user

        scope = asgi_scope("DELETE", MCP_PATH, b"", [(MCP_SESSION_HEADER.encode(), mcp_session.encode())])
        scope["user"] = scope_user(tenant)
        sent: list[Message] = []

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        await self.serve(scope, receive, send)

    async def stop(self) -> None:
        """End every MCP session and the manager (within :data:`STOP_SECONDS`). Default sandbox
        sessions are left to the gateway's ``on_exit``, as every other session."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._runner), STOP_SECONDS)
        except asyncio.TimeoutError:
            log.warning("the MCP session manager did not stop in %.0fs; cancelling it", STOP_SECONDS)
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner


def session_named(body: bytes) -> str | None:
    """The sandbox session one MCP request acts on, if it names one: a ``tools/call``'s
    ``session_id`` argument, or the notebook resource's URI in a ``resources/read``; None for
    anything else (a batch, a call without one, what does not parse: the SDK answers it)."""
    from sandkernel.gateway.mcp.tools import notebook_session

    try:
        message = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep: the SDK answers it
        return None
    params = message.get("params") if isinstance(message, dict) else None
    if not isinstance(params, dict):
        return None
    if message.get("method") == "tools/call":
        arguments = params.get("arguments")
        named = arguments.get("session_id") if isinstance(arguments, dict) else None
    elif message.get("method") == "resources/read":
        named = notebook_session(params.get("uri"))
    else:
        return None
    return named if isinstance(named, str) and 0 < len(named) <= MAX_SESSION_ID_CHARS else None


def asgi_scope(
    method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None = None
) -> Message:
    """An ASGI 3 HTTP scope (the parts the SDK and Starlette read)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": None,
        "state": {},
    }


class McpHandler(BaseHandler):
    """``/mcp``: POST (JSON-RPC messages), GET (a legacy session's server-to-client stream),
    DELETE (end a legacy session), answered by the SDK behind the gateway's checks."""

    mcp: McpHttp
    max_body_bytes = MAX_MCP_BODY_BYTES  # the SDK parses a message on the event loop: keep it small

    def initialize(  # type: ignore[override]
        self,
        registry: SessionRegistry,
        auth: TokenAuth | None,
        settings: GatewaySettings,
        service: SessionService,
        metrics: GatewayMetrics,
        mcp: McpHttp,
        router: Router | None = None,
        traffic: Traffic | None = None,
    ) -> None:
        super().initialize(registry, auth, settings, service, metrics, router, traffic)
        self.mcp = mcp
        self._gone = asyncio.Event()  # the client went away, or the response is complete
        self._body_given = False
        self._status: int | None = None
        self._new_mcp_session: str | None = None

    def prepare(self) -> None:
        super().prepare()  # 503 while stopping, 401/429 on the token, the body limit (max_body_bytes)
        if self.request.method == "GET":
            # A legacy session's GET stream stays open for the session's life and carries no
            # execution's answer: a stopping gateway must not wait for it (Traffic.requests_done).
            self._uncount()

    async def post(self) -> None:
        host = await self._held_elsewhere()
        if host is not None and self.router is not None:
            await self.router.forward(self, host)  # the owner's /mcp answers it, streamed back as it comes
            return
        await self._bridge()

    async def _held_elsewhere(self) -> OtherHost | None:
        """In a cluster, the up host that holds the session a modern MCP request names, when that
        is not this one (None: this gateway answers). A modern request is self-contained, so the
        owner's SDK answers it as if the client had called there; a legacy one belongs to the
        MCP session this gateway's SDK holds, and is answered here (a session held elsewhere is
        then unknown to it, as the docs say)."""
        from sandkernel.gateway.mcp.http_sessions import MCP_SESSION_HEADER

        cluster = self.cluster
        if cluster is None or self.forwarded_from is not None or self.request.headers.get(MCP_SESSION_HEADER):
            return None
        session_id = session_named(self.body)
        if session_id is None or self.registry.holds(self.tenant, session_id):
            return None
        host = await cluster.owner_elsewhere(self.tenant, session_id=session_id)  # 503 if the catalog is away
        return host if host is not None and host.status == "up" else None

    async def get(self) -> None:
        await self._bridge()

    async def delete(self) -> None:
        await self._bridge()

    async def _bridge(self) -> None:
        from sandkernel.gateway.mcp.http_sessions import MCP_SESSION_HEADER, scope_user

        request = self.request
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.get_all()]
        scope = asgi_scope(
            request.method or "GET",
            request.path,
            request.query.encode("latin-1"),
            headers,
            (request.remote_ip or "unknown", 0),
        )
        scope["user"] = scope_user(self.tenant)
        mcp_session = request.headers.get(MCP_SESSION_HEADER)
        sessions = self.mcp.sessions
        sessions.request_started(self.tenant, mcp_session)
        try:
            await self.mcp.serve(scope, self._receive, self._send)
        finally:
            sessions.request_ended(self.tenant, mcp_session)
        if self._status is None:
            if self._gone.is_set():  # the client went away first: there is no one to answer
                return
            raise RuntimeError("the MCP app sent no response")  # a bug of ours or the SDK's
        if mcp_session is None and self._new_mcp_session is not None and self._status < 400:
            sessions.opened(self.tenant, self._new_mcp_session)  # an initialize opened a legacy session
        if request.method == "DELETE" and mcp_session and self._status < 300:
            await sessions.closed(self.tenant, mcp_session)
        if not self._finished:
            self.finish()

    async def _receive(self) -> Message:
        """ASGI ``receive``: the whole body once (already read, within the limit), then
        ``http.disconnect`` when the client goes away or the response is complete."""
        if not self._body_given:
            self._body_given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        """ASGI ``send``: status and headers, then the body; each chunk of a streamed (SSE)
        body but the last is flushed to the client as it comes. Once the client is gone, chunks
        are dropped (the app learns it from ``receive``)."""
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            self.set_status(self._status)
            self.clear_header("Content-Type")
            for raw_name, raw_value in message.get("headers", []):
                name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
                if name.lower() == "mcp-session-id":
                    self._new_mcp_session = value
                self.add_header(name, value)
            return
        if message["type"] != "http.response.body" or self._finished or self._gone.is_set():
            return
        body = message.get("body", b"")
        if body:
            self.write(body)
        if message.get("more_body", False):
            try:
                await self.flush()
            except StreamClosedError:
                self._gone.set()
        # The last chunk is sent by _bridge's finish, after the bookkeeping: a DELETE is answered
        # once the MCP session's default sandbox session is gone.

    def on_finish(self) -> None:
        self._gone.set()
        super().on_finish()

    def on_connection_close(self) -> None:
        self._gone.set()
        super().on_connection_close()
