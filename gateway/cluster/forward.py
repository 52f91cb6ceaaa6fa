"""Forwarding: any gateway of a cluster answers for any session, by passing the request to the
host that holds it.

A request for a session or kernel this gateway does not hold is looked up in the cluster
catalog (:meth:`ClusterLink.owner_elsewhere`); when another host holds the caller's session, the
request goes there unchanged (:func:`forward_http`, :class:`ForwardedChannels` for the kernel
websocket) with the tenant's own ``Authorization`` (the owner authenticates the tenant itself:
every gateway of a cluster has the same tenants' tokens) and a signed ``X-Sandkernel-Forwarded``
header (signing.py). The owner serves a forwarded request itself and never forwards it again.
Nothing is buffered beyond one chunk or one websocket message in each direction: the response
streams through as the owner writes it (an NDJSON execute's lines and keepalives as they come),
each write awaited before the next read, so a slow client slows the owner's socket rather than
filling this gateway's memory. Request bodies are the ones the handler already read, under the
same limits as a local request. An owner that cannot be reached is a 503 (ClusterUnavailableError,
Retry-After) naming the host, never a 500.

Unknown sessions stay 404 wherever they are asked: a session of another tenant is not
forwarded (the catalog says whose it is), so no host answers differently for it than for none.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from tornado import httputil, websocket
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.iostream import StreamClosedError

from sandkernel.errors import ClusterUnavailableError, SandkernelError
from sandkernel.gateway.cluster.peer_pool import Hop, PeerPool
from sandkernel.gateway.cluster.signing import (
    FORWARDED_HEADER,
    PLACE_HERE_HEADER,
    Forwarded,
    NonceLedger,
    credential_of,
    sign,
    verify,
)
from sandkernel.gateway.http_api import MAX_BODY_BYTES
from sandkernel.kernels.model.records import SandboxRecord
from sandkernel.owner_hint import HOST_HEADER

if TYPE_CHECKING:
    from tornado.web import RequestHandler

    from sandkernel.gateway.base import BaseHandler
    from sandkernel.gateway.cluster.catalog import HostInfo

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SECONDS = 5.0
# The longest a forwarded request may take: the longest execute a profile may ask (a day) and a
# margin. The owner's timeout ladder ends every execution before that; this only bounds a hop
# whose owner hangs without closing.
REQUEST_TIMEOUT_SECONDS = 86400.0 + 300.0
# How long a catalog look-up may take before the request is refused (503) rather than held.
CATALOG_TIMEOUT_SECONDS = 5.0
# A forwarded response body: a file download (32 MiB), an NDJSON stream (its outputs are budgeted).
MAX_RESPONSE_BYTES = 4 * MAX_BODY_BYTES
WEBSOCKET_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # as the gateway's own (server.py)
WEBSOCKET_PING_SECONDS = 30.0
# Headers of one hop only (RFC 9110 7.6.1), and ours, which each hop signs afresh.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "server",
        "date",
    }
)
# Close codes a websocket may not send (RFC 6455 7.4.1): they only describe a close.
UNSENDABLE_CLOSE_CODES = frozenset({1005, 1006, 1015})
# What a relayed websocket's client gets when the owner's connection drops without a close
# (RFC 6455 1011, an unexpected condition): Jupyter clients reconnect after it.
CLOSE_HOST_GONE = 1011
# How long a session's host, once found in the catalog, is used without asking again, and how
# many are kept. Short: it bounds how long a moved host URL or a host just marked down is missed.
OWNER_CACHE_SECONDS = 2.0
OWNER_CACHE_ENTRIES = 10_000


class OwnerCatalog(Protocol):
    """What forwarding needs of gateway/cluster/catalog.py's ClusterCatalog."""

    async def owner(self, session_id: str) -> tuple[HostInfo, str] | None: ...

    async def owner_of_kernel(self, kernel_id: str) -> tuple[HostInfo, str, str] | None: ...

    async def place(self, runtime: str) -> HostInfo | None: ...

    async def hosts(self, *, up_only: bool = True) -> list[HostInfo]: ...

    async def tenant_sessions(self, tenant: str) -> list[SandboxRecord]: ...

    async def lost_on_down_host(self, session_id: str, tenant: str) -> SandboxRecord | None: ...

    async def forget_lost(self, session_id: str, tenant: str) -> bool: ...

    async def reserve(self, tenant: str, limit: int | None, session_id: str) -> None: ...

    async def release(self, session_id: str) -> None: ...

    async def known_sessions(self, session_ids: list[str]) -> set[str]: ...


@dataclasses.dataclass
class ClusterLink:
    """What a gateway in cluster mode needs to reach the others: the catalog, the shared secret,
    its own host id and URL. server.py builds it at start (``registry.cluster``); None on a
    single host, where nothing here runs."""

    catalog: OwnerCatalog
    secret: bytes
    host_id: str
    url: str
    # Where sessions (and kernels) of other hosts were found, briefly: a session never moves to
    # another host, so a hot session's requests skip the catalog query (most of a hop's cost);
    # dropped when its host cannot be reached, so a host marked down is asked about again.
    owners: OwnerCache = dataclasses.field(default_factory=lambda: OwnerCache())
    # Kept-alive connections to the other hosts for forwarded HTTP requests (a new TCP
    # connection and a name resolved in a thread per request were most of a hop's cost).
    peers: PeerPool = dataclasses.field(default_factory=lambda: new_peer_pool())
    # Take-overs of paused sessions of down hosts under way here (gateway/cluster/takeover.py):
    # a session's concurrent requests wait for the one take-over.
    takeovers: dict[str, asyncio.Future[bool]] = dataclasses.field(default_factory=dict)
    # The nonces of the forwarded requests this host accepted lately: each is accepted once.
    nonces: NonceLedger = dataclasses.field(default_factory=NonceLedger)

    def forwarded_from(self, request: httputil.HTTPServerRequest) -> Forwarded | None:
        """A request another gateway forwarded, verified (ApiError 401 on a bad, stale or
        replayed signature; its body is checked once in, :meth:`Forwarded.check_body`), or None
        for a request straight from a client."""
        if FORWARDED_HEADER not in request.headers:
            if PLACE_HERE_HEADER in request.headers:
                verify(self.secret, request.headers, request.method or "", request.uri or "")  # refuses: no signature
            return None
        return verify(self.secret, request.headers, request.method or "", request.uri or "", self.nonces)

    def signed(self, method: str, uri: str, headers: Iterable[tuple[str, str]], body: bytes = b"") -> dict[str, str]:
        """The signature header for forwarding a request with these end-to-end ``headers``."""
        return sign(self.secret, method, uri, self.host_id, body=body, credential=credential_of(headers))

    async def ask(self, call: Awaitable[Any], what: str) -> Any:
        """A catalog call, bounded: a catalog that cannot answer is a 503, never a hung request."""
        try:
            return await asyncio.wait_for(call, CATALOG_TIMEOUT_SECONDS)
        except ClusterUnavailableError:
            raise
        except (SandkernelError, OSError, asyncio.TimeoutError) as err:
            raise ClusterUnavailableError(
                f"the cluster catalog cannot be reached to {what} ({type(err).__name__}); retry in a few seconds"
            ) from err

    async def owner_elsewhere(
        self, tenant: str, *, session_id: str | None = None, kernel_id: str | None = None
    ) -> HostInfo | None:
        """The other host holding the tenant's session (or kernel), or None: serve it here (this
        host holds it, or nobody, or another tenant does: the local 404 is the answer)."""
        key = f"s:{session_id}" if session_id is not None else f"k:{kernel_id}"
        found = self.owners.get(key)
        if found is None:
            if session_id is not None:
                found = await self.ask(self.catalog.owner(session_id), "find the session's host")
            else:
                found = await self.ask(self.catalog.owner_of_kernel(str(kernel_id)), "find the kernel's host")
            if found is None:
                return None
            found = (found[0], found[1])
            if found[0].status == "up":
                self.owners.put(key, found)
        host, owner_tenant = found
        if owner_tenant != tenant or host.host_id == self.host_id:
            return None
        return host

    async def lost_with_its_host(self, tenant: str, session_id: str) -> SandboxRecord | None:
        """The record of the tenant's session if it was lost with a host that is down: then no
        gateway holds it and this one answers for it from the catalog (410, the lost model)."""
        return await self.ask(self.catalog.lost_on_down_host(session_id, tenant), "read the session's record")

    async def forget_lost(self, tenant: str, session_id: str) -> bool:
        """Delete the tenant's session lost with a down host (DELETE of it, through any gateway)."""
        return await self.ask(self.catalog.forget_lost(session_id, tenant), "delete the session's record")

    async def place(self, runtime: str) -> HostInfo | None:
        """The host a new session of ``runtime`` goes to (most free room), or None: none has room."""
        return await self.ask(self.catalog.place(runtime), "place the session")

    async def tenant_sessions(self, tenant: str) -> list[SandboxRecord]:
        return await self.ask(self.catalog.tenant_sessions(tenant), "list the tenant's sessions")


class OwnerCache:
    """(host, tenant) of other hosts' sessions and kernels for :data:`OWNER_CACHE_SECONDS`, at
    most :data:`OWNER_CACHE_ENTRIES` (the oldest go first)."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[str, tuple[float, tuple[HostInfo, str]]] = collections.OrderedDict()

    def get(self, key: str) -> tuple[HostInfo, str] | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            self._entries.pop(key, None)
            return None
        return entry[1]

    def put(self, key: str, found: tuple[HostInfo, str]) -> None:
        self._entries[key] = (time.monotonic() + OWNER_CACHE_SECONDS, found)
        self._entries.move_to_end(key)
        while len(self._entries) > OWNER_CACHE_ENTRIES:
            self._entries.popitem(last=False)

    def forget_host(self, host_id: str) -> None:
        """Its host could not be reached: ask the catalog again (it may be down, its sessions lost)."""
        for key in [k for k, (_, (host, _t)) in self._entries.items() if host.host_id == host_id]:
            del self._entries[key]


def new_peer_pool() -> PeerPool:
    """The pool of a gateway's connections to the others, with forwarding's limits."""
    return PeerPool(
        connect_timeout=CONNECT_TIMEOUT_SECONDS,
        request_timeout=REQUEST_TIMEOUT_SECONDS,
        max_response_bytes=MAX_RESPONSE_BYTES,
    )


def cluster_of(registry: object) -> ClusterLink | None:
    """The registry's cluster link (None on a single host, or before server.py sets one)."""
    return getattr(registry, "cluster", None)


def unreachable(host: HostInfo, err: BaseException | str) -> ClusterUnavailableError:
    """The 503 for a request whose session's host cannot be reached."""
    reason = err if isinstance(err, str) else (str(err) or type(err).__name__)
    return ClusterUnavailableError(
        f"host {host.host_id} ({host.url}), which holds this session, cannot be reached: {reason}. Retry in a few "
        f"seconds; if the host stays down (status now {host.status!r}) its running sessions are lost"
    )


def end_to_end(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The client's headers as the owner gets them: the end-to-end ones (Authorization above
    all), never the hop's own nor ours (each hop signs afresh)."""
    return [
        (name, value)
        for name, value in headers
        if (lower := name.lower()) not in HOP_HEADERS
        and not lower.startswith("x-sandkernel-")
        and not lower.startswith("sec-websocket")
    ]


def _end_to_end(request: httputil.HTTPServerRequest) -> list[tuple[str, str]]:
    """:func:`end_to_end` of a request as tornado parsed (and checked) it."""
    return end_to_end(request.headers.get_all())


def _request_headers(request: httputil.HTTPServerRequest) -> httputil.HTTPHeaders:
    """:func:`_end_to_end` as HTTPHeaders (the websocket client's request takes them so)."""
    headers = httputil.HTTPHeaders()
    for name, value in _end_to_end(request):
        headers.add(name, value)
    return headers


class _Relay(httputil.HTTPMessageDelegate):
    """One forwarded HTTP exchange, as the peer pool reads it: the owner's status and headers,
    then its body, chunk by chunk, each written to the client before the next is read."""

    def __init__(self, handler: RequestHandler, host: HostInfo) -> None:
        self.handler = handler
        self.host = host
        self.code = 0
        self.reason = ""
        self.headers = httputil.HTTPHeaders()
        self.started = False  # the owner's status and headers were passed on (with the first chunk)
        self.client_gone = False
        self.hop = Hop()
        self.remaining: int | None = None  # of a body with a Content-Length: bytes still to come

    def headers_received(
        self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine, headers: httputil.HTTPHeaders
    ) -> None:
        assert isinstance(start_line, httputil.ResponseStartLine)
        self.code, self.reason, self.headers = start_line.code, start_line.reason, headers
        length = headers.get("Content-Length")
        self.remaining = int(length) if length is not None and length.isdigit() else None

    def start(self) -> None:
        """Pass the owner's status and end-to-end headers on (once, before the first chunk)."""
        handler = self.handler
        handler.set_status(self.code, self.reason or None)
        handler.clear_header("Content-Type")
        handler.clear_header(HOST_HEADER)  # the owner's answer names the owner (sandkernel/owner_hint.py)
        for name, value in self.headers.get_all():
            if name.lower() not in HOP_HEADERS or name.lower() == "content-length":
                handler.add_header(name, value)
        self.started = True

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        """Awaited by the reader before its next read: each chunk reaches the client before the
        next is read from the owner. A client gone cuts the hop (the read then fails). The last
        piece of a body with a Content-Length is only buffered: the handler's finish sends it
        with the head, in one write (and nothing is left to await)."""
        if not self.started:
            self.start()
        self.handler.write(chunk)
        if self.remaining is not None:
            self.remaining -= len(chunk)
            if self.remaining <= 0:
                return None
        return self._flush()

    async def _flush(self) -> None:
        try:
            await self.handler.flush()
        except StreamClosedError:
            self.cut()

    def cut(self) -> None:
        """The client went away: close the hop (the owner sees its client gone)."""
        self.client_gone = True
        self.hop.cut()


async def forward_http(handler: BaseHandler, host: HostInfo, *, place_here: bool = False) -> None:
    """Send the handler's request (its body already read, under its limits) to ``host`` on a
    kept-alive connection (peer_pool.py) and pass the answer back as it comes. 503
    (ClusterUnavailableError) when the host cannot be reached before anything was answered;
    after that, an NDJSON stream ends with an ``error`` line and any other body is cut (the
    client sees a short response, never a wrong one)."""
    link = cluster_of(handler.registry)
    assert link is not None, "forward_http runs only in cluster mode"
    request = handler.request
    method = request.method or "GET"
    headers = _end_to_end(request)
    body = handler.body
    headers += link.signed(method, request.uri or "/", headers, body).items()
    if place_here:
        headers.append((PLACE_HERE_HEADER, "1"))
    relay = _Relay(handler, host)
    handler.forwarding = relay
    handler.registry.metrics.forwarded.labels("handler").inc()
    error: ConnectionError | None = None
    try:
        await link.peers.fetch(
            host.url,
            method,
            request.uri or "/",
            headers,
            body if body or method in ("POST", "PUT", "PATCH") else None,
            relay,
            relay.hop,
        )
    except ConnectionError as err:
        error = err
    if relay.client_gone:
        return
    if error is None:
        if not relay.started:
            relay.start()
        handler.finish()
        return
    if not relay.started:
        link.owners.forget_host(host.host_id)
        raise unreachable(host, error)
    log.warning("forwarded response from host %s cut: %s", host.host_id, error)
    if "ndjson" in (relay.headers.get("Content-Type") or ""):
        line = {
            "type": "error",
            "status": 503,
            "error": ClusterUnavailableError.code,
            "message": str(unreachable(host, error)),
        }
        with contextlib.suppress(StreamClosedError):
            handler.write(json.dumps(line) + "\n")
            await handler.flush()
        with contextlib.suppress(StreamClosedError):
            handler.finish()
        return
    if request.connection is not None:
        request.connection.close()  # a body cut short: the client must not take it for whole


class ForwardedChannels:
    """A client's kernel websocket relayed to the owner's ``/api/kernels/{id}/channels``.

    Frames pass through unchanged both ways (the owner does all the Jupyter work: signing,
    budgets, the execution path). Each direction awaits its write before reading the next
    message, so the gateway holds at most one message per direction. A close on either side
    closes the other with the same code and reason."""

    def __init__(
        self, handler: websocket.WebSocketHandler, upstream: websocket.WebSocketClientConnection, host_id: str
    ) -> None:
        self.handler = handler
        self.upstream = upstream
        self.host_id = host_id
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls, handler: websocket.WebSocketHandler, link: ClusterLink, host: HostInfo
    ) -> ForwardedChannels | tuple[int, bytes]:
        """Open the websocket to the owner. The owner's refusal (its status and JSON: 404, 429,
        403) is returned to be passed on; ClusterUnavailableError (503) when it cannot be reached."""
        request = handler.request
        parts = urlsplit(host.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        headers = _request_headers(request)
        headers.pop("Origin", None)  # checked by the handler: the owner would compare it with its own Host
        headers.update(link.signed(request.method or "GET", request.uri or "/", headers.get_all()))
        try:
            upstream = await websocket.websocket_connect(
                HTTPRequest(
                    f"{scheme}://{parts.netloc}{parts.path}{request.uri}",
                    headers=headers,
                    connect_timeout=CONNECT_TIMEOUT_SECONDS,
                    request_timeout=CONNECT_TIMEOUT_SECONDS * 2,
                ),
                ping_interval=WEBSOCKET_PING_SECONDS,
                max_message_size=WEBSOCKET_MAX_MESSAGE_BYTES,
            )
        except HTTPClientError as err:
            if err.code != 599 and err.response is not None:
                return err.code, err.response.body or b""
            link.owners.forget_host(host.host_id)
            raise unreachable(host, err) from None
        except (OSError, StreamClosedError, asyncio.TimeoutError) as err:
            link.owners.forget_host(host.host_id)
            raise unreachable(host, err) from None
        return cls(handler, upstream, host.host_id)

    def start(self) -> None:
        """Called from the handler's ``open``: relay the owner's messages to the client."""
        self.task = asyncio.create_task(self._from_owner())

    async def _from_owner(self) -> None:
        while True:
            message = await self.upstream.read_message()
            if message is None:  # the owner closed: so does the client, with its code
                code, reason = self.upstream.close_code, self.upstream.close_reason
                if code is None or code in UNSENDABLE_CLOSE_CODES:  # the host went away without a close
                    code, reason = CLOSE_HOST_GONE, f"the kernel's host {self.host_id} went away; reconnect"
                self.handler.close(code, reason)
                return
            try:
                await self.handler.write_message(message, binary=isinstance(message, bytes))
            except websocket.WebSocketClosedError:
                self.upstream.close()
                return

    async def to_owner(self, message: str | bytes) -> None:
        """A client message, sent on (awaited: the next is read only once this one is written)."""
        try:
            await self.upstream.write_message(message, binary=isinstance(message, bytes))
        except websocket.WebSocketClosedError:
            self.handler.close(1011, "the kernel's host closed the connection")

    def close(self, code: int | None, reason: str | None) -> None:
        """The client closed: close the owner's side with the same code."""
        if self.task is not None:
            self.task.cancel()
        self.upstream.close(code if code is not None and code not in UNSENDABLE_CLOSE_CODES else None, reason)
