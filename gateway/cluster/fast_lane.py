"""The fast lane of a cluster gateway: a request for a session another host holds, relayed
without going through tornado's request handling.

Why: forwarding through tornado cost about 2 ms per call on this project's machine, against a
target of 1 ms (issue 18). A profile put most of it in tornado's server side (parse, route,
handler set-up, the answer's write, the access log), around a hop that costs 0.1 ms itself, and
the thinnest relay Python can be here adds 0.7 ms (bench/README.md). So the gateway owns its
listening socket when it serves plain HTTP in a cluster, and looks at each request before tornado
does, with ``MSG_PEEK``, consuming nothing:

- a request this lane can relay is read off the socket and sent to the owner on the kept-alive
  peer pool, signed like any forwarded request, and the owner's answer is written back as it
  comes (re-framed, never buffered whole);
- anything else is left where it is and the connection is handed to tornado
  (``HTTPServer.handle_stream``), which reads the very same bytes and serves it as before, and
  keeps the connection.

A request is relayed only if everything about it is plain (:func:`plain_request`): HTTP/1.1, a
method of the session API, a path ``/api/sessions/<hex id>[/<word>...]`` with no query but
``?stream=1`` (an NDJSON execute: its lines are passed on as they come), ASCII
headers with token names, at most one ``Content-Length`` and no ``Transfer-Encoding``,
``Upgrade``, ``Expect``, ``X-Sandkernel-*`` (gateways' own, checked by tornado's path) or
``Connection`` other than keep-alive, its head whole in what has arrived (the body may follow), the
body at most :data:`MAX_BODY_BYTES`; and if its token names a tenant, this host does
not hold the session, and the catalog (through the owner cache) says an up host holds it for
that tenant. Everything the lane does not understand goes to tornado, which answers it in full
(400, 401, 413, the local session, the websocket, files, any other query): the
lane can only be skipped, never wrong in a way the slower path is not. The owner checks the
signature and the tenant's token again, as for any forwarded request.

How, in callbacks: the hot path has no task and no await. The client socket's reader (registered
from accept to close) reads the request, signs it and writes it on a kept-alive peer connection
(``PeerPool.send_now``) before it returns; that connection's callback takes a short answer that has
come whole (``PeerPool.answer_now``) and writes it to the client. A body sent after its head is
read as it comes by the same reader. A task is made only for what must wait: the catalog's answer
for a session's first call on a connection, a new peer connection, a streamed or large answer
(``PeerPool.receive``, piece by piece), a client whose socket is full, a failure. Why: on this
machine a task made and run costs 0.07-0.13 ms of a forwarded call, about as much as the lane's
own work (bench/README.md).

With TLS (``--certfile``) tornado owns the socket and every forwarded request takes its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from tornado import httputil, netutil
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream

from sandkernel.errors import ClusterUnavailableError, SandkernelError
from sandkernel.gateway.base import error_reply, retry_after_of
from sandkernel.gateway.cluster.forward import HOP_HEADERS, ClusterLink, end_to_end, unreachable
from sandkernel.gateway.cluster.peer_pool import Exchange, Hop
from sandkernel.gateway.traffic import Traffic

if TYPE_CHECKING:
    from sandkernel.gateway.auth import TokenAuth
    from sandkernel.gateway.registry import SessionRegistry

log = logging.getLogger(__name__)
access_log = logging.getLogger("tornado.access")

FAST_LANE = "fast_lane"  # the metric's label for requests relayed here
PEEK_BYTES = 65536  # what one look at a connection reads (and leaves there)
MAX_BODY_BYTES = 32768  # larger bodies take tornado's path (its limits, its 413)
_REQUEST_LINE = re.compile(
    r"(GET|POST|PUT|DELETE) "
    r"(/api/sessions/([0-9a-f][0-9a-f-]{0,63})(?:/[a-z_]+){0,3}(?:\?stream=(?:1|true))?) HTTP/1\.1"
)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NOT_RELAYED = frozenset({"transfer-encoding", "upgrade", "expect", "te", "trailer"})


@dataclasses.dataclass(frozen=True, slots=True)
class PlainRequest:
    """A request the lane may relay: what :func:`plain_request` read from the head and body."""

    method: str
    target: str
    session_id: str
    headers: list[tuple[str, str]]
    head_size: int  # bytes up to the body
    length: int  # the body's (its Content-Length; 0 without one)

    @property
    def size(self) -> int:
        """Head and body, in bytes: what the lane takes off the socket."""
        return self.head_size + self.length

    def header(self, name: str) -> str | None:
        lower = name.lower()
        return next((value for key, value in self.headers if key.lower() == lower), None)


def plain_request(data: bytes) -> PlainRequest | None:
    """The request whose head starts ``data`` if the lane may relay it (see the module docstring),
    else None: tornado's path then reads it. Its body may not have come yet (a client may send
    it in a second write)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    try:
        lines = data[:end].decode("ascii").split("\r\n")
    except UnicodeDecodeError:
        return None
    found = _REQUEST_LINE.fullmatch(lines[0])
    if found is None:
        return None
    headers: list[tuple[str, str]] = []
    length: int | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        value = value.strip(" \t")
        if not colon or not _HEADER_NAME.fullmatch(name) or not value.isprintable():
            return None  # no name, a folded line, a control character
        lower = name.lower()
        if lower in _NOT_RELAYED or lower.startswith(("x-sandkernel-", "sec-websocket")):
            return None  # ours are signed by gateways only: tornado's path checks (401) what a client sent
        if lower == "connection" and value.lower() != "keep-alive":
            return None
        if lower == "content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        headers.append((name, value))
    if (length or 0) > MAX_BODY_BYTES:
        return None
    method, target, session_id = found.group(1), found.group(2), found.group(3)
    return PlainRequest(method, target, session_id, headers, end + 4, length or 0)


class _Answer(httputil.HTTPMessageDelegate):
    """The owner's answer, written to the client as the peer pool reads it: the head once (with
    the first piece of the body, or at the end), a ``Content-Length`` body as it is, any other
    re-chunked; a short body's last piece waits for :meth:`tail`, so head and body go in one write."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.code = 0
        self.head = b""  # not yet written
        self.pending = b""
        self.chunked = False
        self.remaining: int | None = None
        self.written = False  # something reached the client: a failure now can only cut it

    def headers_received(
        self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine, headers: httputil.HTTPHeaders
    ) -> None:
        assert isinstance(start_line, httputil.ResponseStartLine)
        self.code = start_line.code
        lines = [f"HTTP/1.1 {start_line.code} {start_line.reason or httputil.responses.get(start_line.code, '')}"]
        lines += [f"{name}: {value}" for name, value in headers.get_all() if name.lower() not in HOP_HEADERS]
        length = headers.get("Content-Length")
        if start_line.code in (204, 304):  # no body (the lane relays no HEAD)
            pass
        elif length is not None and length.isdigit():
            lines.append(f"Content-Length: {length}")
            self.remaining = int(length)
        else:
            lines.append("Transfer-Encoding: chunked")
            self.chunked = True
        self.head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        if self.chunked:
            chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        elif self.remaining is not None:
            self.remaining -= len(chunk)
            if self.remaining <= 0:  # the last piece: sent with the head, by tail()
                self.pending += chunk
                return None
        return self._send(chunk)

    def _send(self, piece: bytes) -> Awaitable[None] | None:
        """Write a piece now; what the client's socket cannot take yet is awaited (the peer
        pool then reads no further: a slow client slows the owner's stream, nothing piles up)."""
        data, self.head, self.pending = self.head + self.pending + piece, b"", b""
        self.written = True
        try:
            sent = self.conn.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as err:
            raise ConnectionError(f"the client's connection failed: {err}") from err
        return self.loop.sock_sendall(self.conn, data[sent:]) if sent < len(data) else None

    def tail(self) -> bytes:
        """What is left to write once the answer is whole."""
        end = b"0\r\n\r\n" if self.chunked else b""
        data, self.head, self.pending = self.head + self.pending + end, b"", b""
        return data


class _Client:
    """A client connection the lane holds: its reader stays registered from accept to close (or
    to tornado's taking it), so a relayed request costs no epoll change; ``hop`` is the relay
    under way (None: waiting for its next request)."""

    __slots__ = ("address", "conn", "fd", "hop", "last_active", "partial", "reading", "timer")

    def __init__(self, conn: socket.socket, address: Any, now: float) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        self.address = address
        self.hop: Hop | None = None
        self.partial: _Partial | None = None  # a request whose body is still coming
        self.reading = False
        self.last_active = now
        self.timer: asyncio.TimerHandle | None = None


@dataclasses.dataclass(slots=True)
class _Partial:
    """A request read up to part of its body: the rest is read as it comes."""

    request: PlainRequest
    host: Any
    pieces: list[bytes]
    missing: int


@dataclasses.dataclass(slots=True)
class _Relay:
    """One request being relayed: what passing its answer back needs."""

    client: _Client
    request: PlainRequest
    host: Any
    headers: list[tuple[str, str]]  # as sent to the owner (signed)
    body: bytes | None
    answer: _Answer
    began: float


class FastLane:
    """The listening socket of a plain-HTTP cluster gateway, and the connections it holds between
    requests it relayed (``tornado`` gets every other connection, and keeps it)."""

    def __init__(
        self,
        server: HTTPServer,
        registry: SessionRegistry,
        auth: TokenAuth | None,
        link: ClusterLink,
        idle_seconds: float,
        traffic: Traffic,
    ) -> None:
        self.server, self.registry, self.auth, self.link = server, registry, auth, link
        self.traffic = traffic  # the server's count of requests in flight (a stop lets them answer)
        self.idle_seconds = idle_seconds
        self._listening: list[socket.socket] = []
        self._stop_accepting: list[Any] = []
        self._held: set[_Client] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False
        self._relayed = registry.metrics.forwarded.labels(FAST_LANE)

    # -- the listening socket ------------------------------------------------------------------

    def listen(self, port: int, address: str) -> None:
        """Bind and accept (OSError when the port is taken, as tornado's listen would)."""
        for sock in netutil.bind_sockets(port, address=address):
            self._listening.append(sock)
            self._stop_accepting.append(netutil.add_accept_handler(sock, self._accepted))

    def stop(self) -> None:
        """Accept nothing more; close the connections waiting for their next request (a relay,
        a look-up or a body under way finishes, and its connection is closed then, or handed to
        tornado, which answers 503 while the gateway stops)."""
        self._stopped = True
        for remove in self._stop_accepting:
            remove()
        for sock in self._listening:
            sock.close()
        self._listening.clear()
        for client in list(self._held):
            if client.hop is None and client.partial is None:  # a body under way is read, then relayed
                self._close(client)

    def _accepted(self, conn: socket.socket, address: Any) -> None:
        if self._stopped:
            conn.close()
            return
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop = asyncio.get_running_loop()
        client = _Client(conn, address, loop.time())
        self._held.add(client)
        self._read(client)
        client.timer = loop.call_later(self.idle_seconds, self._check_idle, client)

    # -- one connection --------------------------------------------------------------------------

    def _read(self, client: _Client) -> None:
        if not client.reading:
            asyncio.get_running_loop().add_reader(client.fd, self._readable, client)
            client.reading = True

    def _stop_reading(self, client: _Client) -> None:
        if client.reading:
            client.reading = False
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(client.fd)

    def _check_idle(self, client: _Client) -> None:
        """A connection waiting longer than the idle time for its next request is closed, as
        tornado would; one timer a connection, moved on instead of re-made per request."""
        loop = asyncio.get_running_loop()
        waited = loop.time() - client.last_active
        if client.hop is None and waited >= self.idle_seconds:
            self._close(client)
        else:
            left = self.idle_seconds - waited if client.hop is None else self.idle_seconds
            client.timer = loop.call_later(left, self._check_idle, client)

    def _readable(self, client: _Client) -> None:
        """The client's socket is readable: its next request, more of a body, or (during a relay)
        its going away. A failure the lane did not foresee is a bug: logged, and only this
        connection is closed (a reader left on unread bytes would wake the loop for ever)."""
        try:
            self._on_readable(client)
        except Exception:
            log.exception("bug: the fast lane failed on a request; its connection is closed")
            self._close(client)

    def _on_readable(self, client: _Client) -> None:
        if client.hop is not None:
            self._client_moved(client, client.hop)
            return
        if client.partial is not None:
            self._more_body(client, client.partial)
            return
        try:
            data = client.conn.recv(PEEK_BYTES, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            self._close(client)
            return
        if not data:  # the client closed it
            self._close(client)
            return
        request, tenant = self._relayable(data)
        if request is None or tenant is None:
            self._hand_over(client)
            return
        found = self.link.owners.get(f"s:{request.session_id}")
        if found is None:  # the first call of a session on this connection: the catalog says where it is
            self._stop_reading(client)  # the request stays unread until the catalog answers
            client.hop = Hop()  # busy: neither the idle time nor a stop closes it under the look-up
            self._start(client, self._look_up_and_relay(client, request, tenant))
        elif self._relays_to(found[0], found[1], tenant):
            self._take(client, request, found[0])  # the hot path: no task, no await
        else:
            self._hand_over(client)

    def _relays_to(self, host: Any, owner_tenant: str, tenant: str) -> bool:
        """Whether a request of ``tenant`` is relayed to ``host``, which holds the session for
        ``owner_tenant``: another up host, for the same tenant (else tornado's path answers)."""
        return (
            owner_tenant == tenant and host.host_id != self.link.host_id and host.status == "up" and not self._stopped
        )

    def _start(self, client: _Client, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(self._guarded(client, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, client: _Client, work: Awaitable[None]) -> None:
        """A failure the lane did not foresee is a bug: logged with its traceback, and only this
        connection is closed (the gateway and every other connection go on)."""
        try:
            await work
        except Exception:
            log.exception("bug: the fast lane failed on a request; its connection is closed")
            self._close(client)

    def _relayable(self, data: bytes) -> tuple[PlainRequest | None, str | None]:
        """The request at the head of ``data`` and its tenant, if the lane may relay it: a plain
        request with a good token for a session this host does not hold (else tornado's path)."""
        if self._stopped or self.registry.stopping or self.auth is None:
            return None, None
        request = plain_request(data)
        if request is None:
            return None, None
        tenant = self.auth.tenant_for(request.header("Authorization"))
        if tenant is None:
            return None, None  # tornado's 401 (and its count of failures)
        if self.registry.holds(tenant, request.session_id):
            return None, None  # held here
        return request, tenant

    async def _look_up_and_relay(self, client: _Client, request: PlainRequest, tenant: str) -> None:
        """Ask the catalog (and fill the owner cache) as tornado's path would; a session held
        nowhere else, or a catalog that cannot answer, is tornado's to answer."""
        try:
            host = await self.link.owner_elsewhere(tenant, session_id=request.session_id)
        except (SandkernelError, OSError):
            host = None
        client.hop = None
        if client not in self._held:
            return  # closed meanwhile (a bug elsewhere: nothing closes a busy connection)
        if host is None or not self._relays_to(host, tenant, tenant):
            self._hand_over(client)  # (a stopping gateway's tornado answers 503, come back later)
            return
        self._read(client)
        self._take(client, request, host)

    def _take(self, client: _Client, request: PlainRequest, host: Any) -> None:
        """Read the request off the socket (its head and what came of its body were looked at
        already) and relay it, or, if its body is still coming, read that as it comes
        (:meth:`_more_body`): a client may write its head and its body apart."""
        try:
            taken = client.conn.recv(request.size)
        except OSError:
            self._close(client)
            return
        if len(taken) < request.head_size:  # what was there a moment ago is not: nothing to trust
            self._close(client)
            return
        body = taken[request.head_size :]
        if len(body) < request.length:
            client.partial = _Partial(request, host, [body], request.length - len(body))
            client.last_active = asyncio.get_running_loop().time()
        else:
            self._relay(client, request, body, host)

    def _more_body(self, client: _Client, partial: _Partial) -> None:
        """More of a request's body came; the request is relayed once it is whole (a body that
        does not come within the idle time closes the connection, as tornado would)."""
        try:
            piece = client.conn.recv(partial.missing)
        except BlockingIOError:
            return
        except OSError:
            piece = b""
        if not piece:  # the client closed mid-body
            self._close(client)
            return
        partial.pieces.append(piece)
        partial.missing -= len(piece)
        if partial.missing == 0:
            client.partial = None
            self._relay(client, partial.request, b"".join(partial.pieces), partial.host)

    def _hand_over(self, client: _Client) -> None:
        """Tornado serves this connection from now on (the request is still unread on it)."""
        self._forget(client)
        self.server.handle_stream(IOStream(client.conn), client.address)

    def _forget(self, client: _Client) -> None:
        self._held.discard(client)
        self._stop_reading(client)
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None

    def _close(self, client: _Client) -> None:
        self._forget(client)
        client.conn.close()

    # -- one relayed request -----------------------------------------------------------------------

    def _relay(self, client: _Client, request: PlainRequest, body: bytes, host: Any) -> None:
        """Sign the request and send it to the owner, on a kept-alive connection at once if the
        peer pool has one; a short answer is written back by the connection's callback
        (:meth:`_answered`), any other by a task (:meth:`_pass_answer`)."""
        headers = end_to_end(request.headers)
        headers += self.link.signed(request.method, request.target, headers, body).items()
        sent = body if body or request.method in ("POST", "PUT") else None
        relay = _Relay(client, request, host, headers, sent, _Answer(client.conn), time.monotonic())
        client.hop = Hop()
        self.traffic.request_started()  # from here on every way ends in _done
        self._relayed.inc()
        try:
            exchange = self.link.peers.send_now(host.url, request.method, request.target, headers, sent, client.hop)
        except Exception as err:  # the task answers it (a bug is logged there), and ends the request
            self._start(client, self._pass_answer(relay, err))
            return
        if exchange is None:  # no idle connection to the owner: the task opens one
            self._start(client, self._pass_answer(relay, None))
        else:
            exchange.connection.on_answer = functools.partial(self._answered, relay, exchange)

    def _answered(self, relay: _Relay, exchange: Exchange) -> None:
        """Something came from the owner (or its connection ended): a short answer that is whole
        is written to the client here; an answer still to come in pieces, a stream, a failure,
        go to a task that reads it as tornado's path would."""
        try:
            self._write_whole_answer(relay, exchange)
        except Exception:  # as _guarded: this runs in the peer connection's callback, not a task
            log.exception("bug: the fast lane failed on an answer; its connection is closed")
            exchange.connection.on_answer = None
            exchange.connection.abort(ConnectionError("the fast lane failed"))
            self._done(relay, 0, keep=False)

    def _write_whole_answer(self, relay: _Relay, exchange: Exchange) -> None:
        client, answer = relay.client, relay.answer
        assert client.hop is not None
        whole = self.link.peers.answer_now(exchange, client.hop)
        if whole is None:
            if not exchange.head_pending:
                exchange.connection.on_answer = None
                self._start(client, self._pass_answer(relay, exchange))
            return
        answer.headers_received(whole.start_line, whole.headers)
        if whole.body:
            answer.data_received(whole.body)  # the only piece: kept for tail(), which writes it with the head
        data = answer.tail()
        try:
            written = client.conn.send(data)
        except BlockingIOError:
            written = 0
        except OSError:
            self._done(relay, answer.code, keep=False)
            return
        if written < len(data):  # the client's socket is full: the rest is written when it drains
            self._start(client, self._write_rest(relay, data[written:]))
        else:
            self._done(relay, answer.code, keep=True)

    async def _write_rest(self, relay: _Relay, data: bytes) -> None:
        keep = False
        try:
            await asyncio.get_running_loop().sock_sendall(relay.client.conn, data)
            keep = True
        except OSError:
            pass
        finally:
            self._done(relay, relay.answer.code, keep)

    async def _pass_answer(self, relay: _Relay, exchange: Exchange | BaseException | None) -> None:
        """Read the owner's answer into the client, piece by piece (or send the request first, on
        a new connection, when ``exchange`` is None); a failure before any of it was written is
        answered as tornado's path would."""
        client, request, host, answer = relay.client, relay.request, relay.host, relay.answer
        hop = client.hop
        assert hop is not None
        status = 0
        keep = False
        try:
            try:
                if isinstance(exchange, BaseException):
                    raise exchange
                if exchange is None:
                    await self.link.peers.fetch(
                        host.url, request.method, request.target, relay.headers, relay.body, answer, hop
                    )
                else:
                    await self.link.peers.receive(exchange, answer, hop)
                data = answer.tail()
                status = answer.code
            except ConnectionError as err:
                if hop.cut_off:
                    return  # the client left: the owner saw it go
                if answer.written:
                    log.warning("relayed answer from host %s cut: %s", host.host_id, err)
                    return  # the client has a short answer: its connection closes
                self.link.owners.forget_host(host.host_id)
                data, status = _error_answer(unreachable(host, err))
            if hop.cut_off:
                return
            await asyncio.get_running_loop().sock_sendall(client.conn, data)
            keep = True
        except OSError:
            return
        finally:
            self._done(relay, status, keep)

    def _done(self, relay: _Relay, status: int, keep: bool) -> None:
        """A relayed request ended: logged; its connection waits for the next one (or is closed)."""
        client = relay.client
        self.traffic.request_ended()
        _log_access(status, relay.request, client.address, relay.began)
        client.hop = None
        if keep and not self._stopped:
            client.last_active = asyncio.get_running_loop().time()
            self._read(client)
        else:
            self._close(client)

    def _client_moved(self, client: _Client, hop: Hop) -> None:
        """The client's side is readable during a relay: gone (the owner then sees its client
        gone, as a local handler would), or it sent its next request early (its reader is off
        until the answer is written, and the request is read then)."""
        self._stop_reading(client)
        try:
            gone = client.conn.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            hop.cut()


def _error_answer(err: ClusterUnavailableError) -> tuple[bytes, int]:
    """The JSON error tornado's path gives for the same failure (base.error_reply's mapping,
    base.write_error's shape), and its status."""
    status, code, message = error_reply(err)
    body = json.dumps({"error": code, "message": message}).encode()
    seconds = retry_after_of(err)
    retry = f"Retry-After: {seconds}\r\n" if seconds is not None else ""
    head = (
        f"HTTP/1.1 {status} {httputil.responses.get(status, '')}\r\nContent-Type: application/json\r\n{retry}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body, status


def _log_access(status: int, request: PlainRequest, address: Any, began: float) -> None:
    """The access-log line of a relayed request, as tornado's path writes it (server.log_request)
    and marked as relayed here. An answer the owner gave is its access log's line too: here it
    is DEBUG (0.1 ms a call on this machine's profile); a failure here is logged as tornado's
    path would."""
    level = logging.DEBUG if 0 < status < 400 else logging.WARNING if 0 < status < 500 else logging.ERROR
    if not access_log.isEnabledFor(level):
        return
    remote = address[0] if isinstance(address, tuple) and address else str(address)
    access_log.log(
        level,
        "%d %s %s (%s) %.2fms (fast lane)",
        status,
        request.method,
        request.target,
        remote,
        1000.0 * (time.monotonic() - began),
    )
