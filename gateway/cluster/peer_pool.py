"""Kept-alive HTTP/1.1 connections to the other gateways of a cluster, for forwarded requests.

Why: a forwarded execute used to open a new TCP connection per request (tornado's
SimpleAsyncHTTPClient has no keep-alive) and resolve the owner's host name in a thread each time;
that was most of the ~3 ms a hop added (bench/cluster.py). Here each peer (scheme, host, port)
has a small LIFO of idle connections; a request takes the most recently used one, or opens one.

How: each connection is an asyncio protocol (:class:`_Connection`) with a small HTTP/1.1
response reader of its own: the request goes out in one write (head and body), the answer's
head is parsed once, its body is handed to the caller's
:class:`~tornado.httputil.HTTPMessageDelegate` as it arrives (``data_received`` awaited before
the next piece is taken: streaming stays streaming), chunked framing undone on the way. Why not
tornado's HTTP1Connection on an IOStream, which this used before: per exchange it built a
connection object and a chain of futures and callbacks, and the stream took its socket out of
epoll after each read and put it back for the next (syscalls and Python both); the client's CPU
per exchange measured 0.26 ms with it, 0.13-0.17 ms now (bench/cluster.py, "the hop's client
alone"), and the forwarder's CPU per forwarded execute 11-13 % less in an A/B of both forwarders
in front of one owner. An asyncio transport keeps its socket registered and reads as data
comes, so an exchange whose answer arrives in one segment costs one wake-up. Backpressure: at
most :data:`READ_BUFFER_BYTES` waits in a connection's buffer; past it the transport stops
reading until the caller took it, so a slow client slows the peer's socket, nothing more is
buffered.

Bounds: at most :data:`MAX_IDLE_PER_PEER` idle connections per peer (a connection returned to a
full pool is closed); one unused for :data:`IDLE_SECONDS` is no longer lent, and is closed the
next time the pool is used (no timer per connection: the peer's own idle limit closes one never
asked for again, and it leaves the pool then). That is below the peer
gateway's own idle limit (``--header-timeout``, 20 s by default, after which tornado's server
closes a kept-alive connection), so the peer rarely closes one the pool would still lend. When it
does (a lower ``--header-timeout``, a restart): an idle connection that sees the close (or stray
bytes) leaves the pool at once, and one is checked again on check-out. What is left is a close
racing the request on the wire; such a request, having failed on a *reused* connection before
any byte of the answer came, is sent once more on a fresh connection, but only if nothing of it
was sent or its method is idempotent (a POST execute is never run twice). A failure on a fresh
connection is the caller's 503.

Names: an IP-literal peer URL is connected to as is (no resolver, no thread); a host name is
resolved through the loop's getaddrinfo (a worker thread) and the answer kept
:data:`RESOLVE_CACHE_SECONDS`, so a steady stream of forwards resolves nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from tornado import httputil

log = logging.getLogger(__name__)

# A request's headers: tornado's, or (name, value) pairs a caller already has checked.
Headers = httputil.HTTPHeaders | list[tuple[str, str]]

# Idle connections kept per peer: enough for the forwards one gateway has in flight to one peer
# at a time on a busy host; more concurrent ones open connections that are closed after use.
MAX_IDLE_PER_PEER = 16
# Seconds an idle connection is kept: half the peer's default idle limit (--header-timeout, 20 s).
IDLE_SECONDS = 10.0
# Seconds a resolved host name is used before it is resolved again.
RESOLVE_CACHE_SECONDS = 30.0
# Methods that may be sent twice (RFC 9110 9.2.2): a request that failed on a reused connection
# is resent only if it is one of these (or if nothing of it was sent).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
MAX_HEADER_BYTES = 64 * 1024  # tornado's server default: no gateway sends more
# The most a connection reads ahead of its caller (one chunk, as tornado's 64 KiB reads): past
# it the transport stops reading until the caller has taken what is there.
READ_BUFFER_BYTES = 64 * 1024
MAX_CHUNK_LINE_BYTES = 1024  # a chunk's size line (hex size and extensions)
# A response's header lines after its status line, each ending in CRLF, then the empty line:
# field-name is a token, field-value any octet but a control one (HTAB allowed) (RFC 9110 5.1, 5.5).
_FIELDS = re.compile(r"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*\r\n")


@dataclasses.dataclass(frozen=True)
class Peer:
    """Where a peer listens, parsed once from its URL: the pool's key."""

    scheme: str
    host: str
    port: int
    netloc: str  # the Host header

    @classmethod
    def of(cls, url: str) -> Peer:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a peer URL is http(s)://host[:port], not {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.netloc)


class PeerError(ConnectionError):
    """An exchange with a peer failed: it could not be reached, closed the connection, sent a
    malformed or over-limit answer, or timed out (the message says which)."""


class Hop:
    """The caller's handle on one forwarded exchange: :meth:`cut` closes the connection it is on
    (the client went away: the peer sees its client gone) and stops any resend."""

    def __init__(self) -> None:
        self.connection: _Connection | None = None
        self.cut_off = False

    def cut(self) -> None:
        self.cut_off = True
        if self.connection is not None:
            self.connection.abort(PeerError("the client went away"))


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection to a peer: what arrived and is not taken yet, and the one
    waiter (the exchange's coroutine) woken when more arrives or the connection ends."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.error: BaseException | None = None  # why it ended (None while open)
        self.eof = False
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.busy = False  # an exchange is using it (else: idle in the pool, or new)
        self.on_idle_event: Any = None  # the pool's callback while idle: it closed, or sent stray bytes
        # while busy: called instead of waking a reader (PeerPool.answer_now's caller)
        self.on_answer: Callable[[], None] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) >= READ_BUFFER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._notify()

    def eof_received(self) -> bool:
        self.eof = True
        self._notify()
        return False  # the transport closes itself

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.error is None:
            self.error = exc or PeerError("the connection closed")
        self._notify()

    def _notify(self) -> None:
        """Something arrived or the connection ended: the exchange's reader is woken (or its
        ``on_answer`` called), or the pool told of an idle connection's close or stray bytes."""
        self._wake()
        if self.busy:
            if self.on_answer is not None:
                self.on_answer()
        elif self.on_idle_event is not None:
            self.on_idle_event(self)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the exchange's side ---------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Open, nothing unasked-for waiting, no end seen: an idle connection that can carry a request."""
        return self.error is None and not self.eof and not self.buffer and self.transport is not None

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def abort(self, error: BaseException) -> None:
        """Close now, unsent data dropped (a cut, a timeout): any read under way fails with ``error``."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def close(self) -> None:
        """Close cleanly (its FIN after any data still to send)."""
        if self.error is None:
            self.error = PeerError("the connection was closed")
        if self.transport is not None:
            self.transport.close()
        self._wake()

    async def _more(self) -> None:
        """Wait until more data came or the connection ended (raises why it ended)."""
        if self.error is not None:
            raise self.error
        if self.eof:
            raise PeerError("the connection closed before the answer was complete")
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.buffer:
            raise self.error

    def _take(self, n: int) -> bytes:
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        if self.paused and len(self.buffer) < READ_BUFFER_BYTES and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def read_until(self, delimiter: bytes, max_bytes: int) -> bytes:
        """Up to and with ``delimiter``; HTTPInputError past ``max_bytes`` without it."""
        start = 0
        while True:
            found = self.buffer.find(delimiter, start)
            if found >= 0:
                if found + len(delimiter) > max_bytes:
                    raise httputil.HTTPInputError(f"more than {max_bytes} bytes without {delimiter!r}")
                return self._take(found + len(delimiter))
            if len(self.buffer) > max_bytes:
                raise httputil.HTTPInputError(f"more than {max_bytes} bytes without {delimiter!r}")
            start = max(0, len(self.buffer) - len(delimiter) + 1)
            await self._more()

    async def read_some(self, max_bytes: int) -> bytes:
        """What is there (at least one byte), at most ``max_bytes``."""
        while not self.buffer:
            await self._more()
        return self._take(max_bytes)

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            await self._more()
        return self._take(n)


@dataclasses.dataclass(eq=False)
class Exchange:
    """A request handed to a connection, and what reading its answer (or sending it again) needs."""

    peer: Peer
    method: str
    target: str
    request: list[bytes]  # as written, for a resend
    connection: _Connection
    reused: bool  # kept from an earlier exchange (only such a failure may be sent again)
    timer: asyncio.TimerHandle  # the exchange's time limit
    sent: bool = False  # handed to the transport (a failure to send shows on the read)

    @property
    def head_pending(self) -> bool:
        """The answer's head has not come whole, and may still: worth waiting for before
        :meth:`PeerPool.answer_now` is asked again."""
        connection = self.connection
        return (
            self.sent
            and connection.error is None
            and not connection.eof
            and len(connection.buffer) < MAX_HEADER_BYTES
            and b"\r\n\r\n" not in connection.buffer
        )


class WholeAnswer(NamedTuple):
    """A peer's answer read whole (:meth:`PeerPool.answer_now`)."""

    start_line: httputil.ResponseStartLine
    headers: httputil.HTTPHeaders
    body: bytes


@dataclasses.dataclass
class _Idle:
    connection: _Connection
    until: float  # time.monotonic() after which it is not lent any more


def _parse_head(data: bytes) -> tuple[httputil.ResponseStartLine, httputil.HTTPHeaders]:
    """A response's status line and headers, the whole head checked against RFC 9110's field
    syntax in one match (:data:`_FIELDS`: a token, a colon, no control character but HTAB; no
    obsolete line folding), so a peer's malformed header is refused, never passed on. Raises
    HTTPInputError."""
    text = data.decode("latin1")
    start, _, fields = text.partition("\r\n")
    start_line = httputil.parse_response_start_line(start)
    if not _FIELDS.fullmatch(fields):
        bad = next((line for line in fields.split("\r\n") if line and not _FIELDS.fullmatch(line + "\r\n")), "")
        raise httputil.HTTPInputError(f"malformed header line {bad[:80]!r}")
    headers = httputil.HTTPHeaders()
    for line in fields.split("\r\n"):
        if line:
            name, _, value = line.partition(":")
            value = value.strip(" \t")
            if name in headers:
                headers.add(name, value)
            else:
                headers[name] = value  # checked above (add would check it again, twice)
    return start_line, headers


def _request_head(method: str, target: str, netloc: str, headers: Headers, body: bytes | None) -> bytes:
    """The request's head as it goes on the wire (Host and Content-Length set here)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {netloc}"]
    for name, value in headers.get_all() if isinstance(headers, httputil.HTTPHeaders) else headers:
        if "\n" in value or "\r" in value:  # a value set without tornado's check (headers[name] = ...)
            raise ValueError(f"header {name} has a line break")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin1")


class PeerPool:
    """Kept-alive connections to the peers of one gateway (one per :class:`ClusterLink`).

    Only the event loop's thread uses it. ``opened`` and ``reused`` count connections opened and
    exchanges sent on a kept one (for tests and the bench)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        request_timeout: float,
        max_response_bytes: int,
        max_idle_per_peer: int = MAX_IDLE_PER_PEER,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.max_response_bytes = max_response_bytes
        self.max_idle_per_peer = max_idle_per_peer
        self.idle_seconds = idle_seconds
        self._idle: dict[Peer, collections.deque[_Idle]] = {}
        self._peers: dict[str, Peer] = {}
        self._addresses: dict[tuple[str, int], tuple[float, list[tuple[int, Any]]]] = {}
        self._tls: ssl.SSLContext | None = None
        self.opened = 0
        self.reused = 0

    # -- the exchange ------------------------------------------------------------------------------

    async def fetch(
        self,
        url: str,
        method: str,
        target: str,
        headers: Headers,
        body: bytes | None,
        delegate: httputil.HTTPMessageDelegate,
        hop: Hop,
    ) -> None:
        """Send ``method target`` with ``headers`` (end-to-end ones, as HTTPHeaders or (name,
        value) pairs; Host and Content-Length are added here) and ``body`` (None: no body) to
        the peer at ``url``; the response goes to ``delegate`` as it is read
        (``headers_received``, then ``data_received`` per piece of the body, each awaited, then
        ``finish``). Returns once the whole response was read. Raises ConnectionError
        (PeerError, the cause chained) when the peer cannot be reached, closes mid-way, sends a
        malformed or over-limit answer, or times out; the delegate was then told
        ``on_connection_close`` if its headers had come."""
        peer = self._peer(url)
        request = self._wire(url, method, target, headers, body)
        exchange = self._send_kept(peer, method, target, request, hop)
        if exchange is None:
            exchange = await self._send_on_new(peer, method, target, request, hop)
        await self.receive(exchange, delegate, hop)

    def send_now(
        self, url: str, method: str, target: str, headers: Headers, body: bytes | None, hop: Hop
    ) -> Exchange | None:
        """Send the request on a kept-alive connection to ``url`` without awaiting anything, if
        the pool has an idle one (None: it has none; :meth:`fetch` opens one). Why: a caller in a
        reader's callback (the fast lane) has the request on its way to the peer before any task
        is made, and the rest of its work overlaps the peer's. :meth:`receive` reads the answer."""
        return self._send_kept(self._peer(url), method, target, self._wire(url, method, target, headers, body), hop)

    async def receive(self, exchange: Exchange, delegate: httputil.HTTPMessageDelegate, hop: Hop) -> None:
        """Read the answer to a sent exchange into ``delegate`` (see :meth:`fetch`); a request that
        failed on a kept-alive connection before any answer came is sent once more on a new one
        if nothing of it was sent or its method is idempotent."""
        while True:
            connection = exchange.connection
            answered = finished = keep_alive = False
            failure: BaseException | None = None
            try:
                if not exchange.sent:
                    raise connection.error or PeerError("the connection closed")
                start_line, response_headers = await self._read_head(connection)
                answered = True
                keep_alive = (
                    start_line.version == "HTTP/1.1" and (response_headers.get("Connection") or "").lower() != "close"
                )
                await _maybe(delegate.headers_received(start_line, response_headers))
                framed = await self._read_body(connection, exchange.method, start_line.code, response_headers, delegate)
                keep_alive = keep_alive and framed
                finished = True
                delegate.finish()
            except (OSError, httputil.HTTPInputError, ValueError) as err:  # PeerError is an OSError
                failure = err
            except BaseException:  # cancelled, or the delegate failed: the connection is not reused
                connection.abort(PeerError("the exchange was abandoned"))
                raise
            finally:
                exchange.timer.cancel()
            if finished:
                self._finished(exchange, hop, keep_alive)
                return
            connection.abort(failure or PeerError("the connection closed"))
            if answered:
                delegate.on_connection_close()
            resend = (
                exchange.reused
                and not answered
                and not hop.cut_off
                and (not exchange.sent or exchange.method in IDEMPOTENT_METHODS)
            )
            if not resend:
                raise PeerError(_reason(failure)) from failure
            log.info(
                "kept-alive connection to %s closed; %s %s sent again on a new one",
                exchange.peer.netloc,
                exchange.method,
                exchange.target,
            )
            exchange = await self._send_on_new(exchange.peer, exchange.method, exchange.target, exchange.request, hop)

    def answer_now(self, exchange: Exchange, hop: Hop) -> WholeAnswer | None:
        """The exchange's answer if it is whole in what has arrived and plain: a final status, its
        body framed by ``Content-Length`` (or none: 204, 304) and at most
        :data:`READ_BUFFER_BYTES`, in the connection's buffer; the connection then goes back to
        the pool. None: not (yet); :meth:`receive` reads it, with every check and failure of its
        own. Why: the fast lane writes a short answer back in the callback that read it, with no
        task woken for it (see :attr:`Exchange.head_pending` for when to wait for more)."""
        connection = exchange.connection
        buffer = connection.buffer
        end = buffer.find(b"\r\n\r\n")
        if not exchange.sent or connection.error is not None or not 0 <= end <= MAX_HEADER_BYTES or buffer[:1] == b"\r":
            return None
        if buffer.find(b"chunked", 0, end) >= 0:
            return None  # a stream, most likely: not parsed twice (receive reads it)
        try:
            start_line, headers = _parse_head(bytes(buffer[: end + 4]))
        except (httputil.HTTPInputError, ValueError):
            return None  # receive reads it again, and fails it with its reason
        if start_line.code < 200 or "Transfer-Encoding" in headers:
            return None
        length = headers.get("Content-Length")
        if exchange.method == "HEAD" or start_line.code in (204, 304):
            size = 0
        elif length is None or not length.isdigit() or int(length) > min(READ_BUFFER_BYTES, self.max_response_bytes):
            return None
        else:
            size = int(length)
        if len(buffer) < end + 4 + size:
            return None
        connection.on_answer = None
        connection._take(end + 4)
        body = connection._take(size)
        exchange.timer.cancel()
        keep_alive = start_line.version == "HTTP/1.1" and (headers.get("Connection") or "").lower() != "close"
        self._finished(exchange, hop, keep_alive)
        return WholeAnswer(start_line, headers, body)

    def _finished(self, exchange: Exchange, hop: Hop, keep_alive: bool) -> None:
        """An answer was read whole: its connection is kept for the next exchange, or closed."""
        hop.connection = None  # a late cut must not close it under another exchange
        if keep_alive and exchange.connection.usable:
            self._check_in(exchange.peer, exchange.connection)
        else:
            exchange.connection.close()

    def _peer(self, url: str) -> Peer:
        return self._peers.get(url) or self._peers.setdefault(url, Peer.of(url))

    def _wire(self, url: str, method: str, target: str, headers: Headers, body: bytes | None) -> list[bytes]:
        """The request as it is written: one piece, so head and body leave in one segment (a
        large body is not copied for it)."""
        head = _request_head(method, target, self._peer(url).netloc, headers, body)
        return [head + body] if body and len(body) <= READ_BUFFER_BYTES else [head, body] if body else [head]

    def _send_kept(self, peer: Peer, method: str, target: str, request: list[bytes], hop: Hop) -> Exchange | None:
        """Send on an idle kept-alive connection, if there is one (the request is built first: a
        bad header fails before a connection is lent)."""
        connection = self._lend(peer)
        if connection is None:
            return None
        return self._send(peer, method, target, request, connection, True, hop)

    async def _send_on_new(self, peer: Peer, method: str, target: str, request: list[bytes], hop: Hop) -> Exchange:
        connection = await self._connect(peer)
        connection.busy = True
        return self._send(peer, method, target, request, connection, False, hop)

    def _send(
        self,
        peer: Peer,
        method: str,
        target: str,
        request: list[bytes],
        connection: _Connection,
        reused: bool,
        hop: Hop,
    ) -> Exchange:
        """Hand the request to the connection's transport (a failure to send shows when the answer
        is read), with the exchange's time limit: a peer that hangs without closing is aborted."""
        hop.connection = connection
        if hop.cut_off:
            connection.abort(PeerError("the client went away"))
            raise PeerError("the client went away")
        timer = asyncio.get_running_loop().call_later(self.request_timeout, connection.abort, PeerError("timed out"))
        exchange = Exchange(peer, method, target, request, connection, reused, timer)
        if connection.usable:
            exchange.sent = True
            for data in request:
                connection.write(data)
        return exchange

    @staticmethod
    async def _read_head(connection: _Connection) -> tuple[httputil.ResponseStartLine, httputil.HTTPHeaders]:
        """The answer's status line and headers (1xx interim answers skipped)."""
        while True:
            head = await connection.read_until(b"\r\n\r\n", MAX_HEADER_BYTES)
            start_line, headers = _parse_head(head.lstrip(b"\r\n"))
            if not 100 <= start_line.code < 200:
                return start_line, headers
            if start_line.code == 101 or "Content-Length" in headers or "Transfer-Encoding" in headers:
                raise httputil.HTTPInputError(f"unexpected interim answer {start_line.code}")

    async def _read_body(
        self,
        connection: _Connection,
        method: str,
        code: int,
        headers: httputil.HTTPHeaders,
        delegate: httputil.HTTPMessageDelegate,
    ) -> bool:
        """Pass the body on as it comes; whether the connection may carry another exchange."""
        if method == "HEAD" or code in (204, 304):
            return True
        encoding = headers.get("Transfer-Encoding")
        if encoding is not None:
            if encoding.lower() != "chunked" or "Content-Length" in headers:
                raise httputil.HTTPInputError(f"unsupported framing: Transfer-Encoding {encoding!r}")
            await self._read_chunked(connection, delegate)
            return True
        length = headers.get("Content-Length")
        if length is None:  # the body ends when the connection does (HTTP/1.0 style)
            await self._read_to_close(connection, delegate)
            return False
        if not length.isdigit():
            raise httputil.HTTPInputError(f"bad Content-Length {length[:40]!r}")
        remaining = int(length)
        self._check_size(remaining)
        while remaining:
            piece = await connection.read_some(min(remaining, READ_BUFFER_BYTES))
            remaining -= len(piece)
            await _maybe(delegate.data_received(piece))
        return True

    async def _read_to_close(self, connection: _Connection, delegate: httputil.HTTPMessageDelegate) -> None:
        total = 0
        while True:
            try:
                piece = await connection.read_some(READ_BUFFER_BYTES)
            except OSError:
                if connection.eof and not connection.buffer:
                    return
                raise
            total += len(piece)
            self._check_size(total)
            await _maybe(delegate.data_received(piece))

    async def _read_chunked(self, connection: _Connection, delegate: httputil.HTTPMessageDelegate) -> None:
        total = 0
        while True:
            line = await connection.read_until(b"\r\n", MAX_CHUNK_LINE_BYTES)
            size_text = line[:-2].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise httputil.HTTPInputError(f"bad chunk size {size_text[:40]!r}") from None
            if size == 0:  # the last chunk; then trailers (dropped) up to an empty line
                while await connection.read_until(b"\r\n", MAX_HEADER_BYTES) != b"\r\n":
                    pass
                return
            total += size
            self._check_size(total)
            while size:  # a large chunk is passed on in pieces of at most READ_BUFFER_BYTES
                piece = await connection.read_some(min(size, READ_BUFFER_BYTES))
                size -= len(piece)
                await _maybe(delegate.data_received(piece))
            if await connection.read_exactly(2) != b"\r\n":
                raise httputil.HTTPInputError("a chunk does not end with CRLF")

    def _check_size(self, total: int) -> None:
        if total > self.max_response_bytes:
            raise httputil.HTTPInputError(f"the answer is over the limit of {self.max_response_bytes} bytes")

    # -- the pool ----------------------------------------------------------------------------------

    def _lend(self, peer: Peer) -> _Connection | None:
        """An idle connection to ``peer`` kept from an earlier exchange, marked busy (None: none is left)."""
        idle = self._idle.get(peer)
        if idle:
            self._expire_idle(idle)
        while idle:
            connection = idle.pop().connection
            connection.on_idle_event = None
            if connection.usable:
                connection.busy = True
                self.reused += 1
                return connection
            connection.close()
        return None

    def _check_in(self, peer: Peer, connection: _Connection) -> None:
        """Keep ``connection`` for the next exchange with ``peer`` (closed if the pool is full)."""
        idle = self._idle.setdefault(peer, collections.deque())
        self._expire_idle(idle)
        if len(idle) >= self.max_idle_per_peer:
            connection.close()
            return
        connection.busy = False
        idle.append(_Idle(connection, time.monotonic() + self.idle_seconds))
        # The peer's close (or bytes nobody asked for) while idle: the entry leaves the pool.
        connection.on_idle_event = lambda c: self._drop(peer, c)

    @staticmethod
    def _expire_idle(idle: collections.deque[_Idle]) -> None:
        """Close the connections idle past :attr:`idle_seconds` (the oldest are on the left).
        Done as the pool is used, not on a timer per connection: one that is never asked for
        again is closed by its peer's own idle limit, and leaves the pool then."""
        now = time.monotonic()
        while idle and idle[0].until <= now:
            entry = idle.popleft()
            entry.connection.on_idle_event = None
            entry.connection.close()

    def _drop(self, peer: Peer, connection: _Connection) -> None:
        """An idle connection the peer closed (or sent stray bytes on): out of the pool."""
        connection.on_idle_event = None
        idle = self._idle.get(peer)
        if idle:
            for entry in idle:
                if entry.connection is connection:
                    idle.remove(entry)
                    break
        connection.close()

    def idle_count(self, url: str) -> int:
        """Idle connections kept for the peer at ``url`` and not past their idle time."""
        idle = self._idle.get(Peer.of(url))
        if idle is None:
            return 0
        self._expire_idle(idle)
        return len(idle)

    def close(self) -> None:
        """Close every idle connection (the gateway stops)."""
        for idle in self._idle.values():
            while idle:
                entry = idle.pop()
                entry.connection.on_idle_event = None
                entry.connection.close()

    # -- opening connections -----------------------------------------------------------------------

    async def _connect(self, peer: Peer) -> _Connection:
        """A new connection (TCP_NODELAY, as asyncio sets on every TCP transport; TLS for
        https), within the connect timeout. Raises PeerError naming what failed."""
        loop = asyncio.get_running_loop()
        last: BaseException | None = None
        for family, address in await self._resolve(peer):
            try:
                _, connection = await asyncio.wait_for(
                    loop.create_connection(
                        _Connection,
                        address[0],
                        address[1],
                        family=family,
                        ssl=self._tls_context() if peer.scheme == "https" else None,
                        server_hostname=peer.host if peer.scheme == "https" else None,
                    ),
                    self.connect_timeout,
                )
            except (OSError, asyncio.TimeoutError) as err:
                last = err
                continue
            assert connection.transport is not None
            sock = connection.transport.get_extra_info("socket")
            if sock is not None and family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.opened += 1
            return connection
        if isinstance(last, asyncio.TimeoutError):
            raise PeerError(f"no connection within {self.connect_timeout:g} s") from last
        raise PeerError(_reason(last)) from last

    async def _resolve(self, peer: Peer) -> list[tuple[int, Any]]:
        """(family, sockaddr) to try: an IP literal as is; a name from the cache or getaddrinfo."""
        try:
            ip = ipaddress.ip_address(peer.host)
        except ValueError:
            pass
        else:
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            return [(family, (peer.host, peer.port))]
        key = (peer.host, peer.port)
        cached = self._addresses.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
        except OSError as err:
            raise PeerError(f"cannot resolve {peer.host}: {err}") from err
        addresses = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
        self._addresses[key] = (time.monotonic() + RESOLVE_CACHE_SECONDS, addresses)
        return addresses

    def _tls_context(self) -> ssl.SSLContext:
        """Certificates verified, as tornado's client does by default (built once: it reads the CA store)."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


async def _maybe(result: Awaitable[None] | None) -> None:
    """Await what a delegate's method returned, if anything (HTTPMessageDelegate's methods may
    return an awaitable: the next read waits for it)."""
    if result is not None:
        await result


def _reason(err: BaseException | None) -> str:
    """A short why for a failed exchange (its message goes into the 503)."""
    if err is None:
        return "the connection closed before the answer was complete"
    if isinstance(err, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    if isinstance(err, ssl.SSLError):  # its own words: "certificate verify failed: ..." (its errno is OpenSSL's)
        return str(err)
    if isinstance(err, OSError) and err.errno is not None:  # "Connection refused", not asyncio's "Connect call failed"
        return os.strerror(err.errno)
    return str(err) or type(err).__name__
