"""Kept-alive HTTP/1.1 connections to the other gateways of a cluster, for forwarded requests.

Why: a forwarded execute used to open a new TCP connection per request (tornado's
SimpleAsyncHTTPClient has no keep-alive) and resolve the owner's host name in a thread each time;
that was most of the ~3 ms a hop added (bench/cluster.py). Here each peer (scheme, host, port)
has a small LIFO of idle connections; a request takes the most recently used one, or opens one.

How: tornado's own HTTP/1.1 framing (:class:`tornado.http1connection.HTTP1Connection`, client
side) on an :class:`~tornado.iostream.IOStream`; one HTTP1Connection per exchange, the stream
kept for the next. The response goes to the caller's :class:`~tornado.httputil.HTTPMessageDelegate`
as it is read (``data_received`` awaited before the next read: streaming stays streaming).

Bounds: at most :data:`MAX_IDLE_PER_PEER` idle connections per peer (a connection returned to a
full pool is closed); one unused for :data:`IDLE_SECONDS` is no longer lent, and is closed the
next time the pool is used (no timer per connection: the peer's own idle limit closes one never
asked for again, and it leaves the pool then). That is below the peer
gateway's own idle limit (``--header-timeout``, 20 s by default, after which tornado's server
closes a kept-alive connection), so the peer rarely closes one the pool would still lend. When it
does (a lower ``--header-timeout``, a restart): an idle stream listens for the close and leaves
the pool when it comes; on check-out a non-blocking peek drops one whose close (or stray bytes)
arrived unnoticed. What is left is a close racing the request on the wire; such a request,
having failed on a *reused* connection before any byte of the answer came, is sent once more on
a fresh connection, but only if nothing of it was sent or its method is idempotent (a POST
execute is never run twice). A failure on a fresh connection is the caller's 503.

Names: an IP-literal peer URL is connected to as is (no resolver, no thread); a host name is
resolved through the loop's getaddrinfo (a worker thread) and the answer kept
:data:`RESOLVE_CACHE_SECONDS`, so a steady stream of forwards resolves nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import ipaddress
import logging
import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

from tornado import gen, httputil
from tornado.http1connection import HTTP1Connection, HTTP1ConnectionParameters
from tornado.iostream import IOStream, StreamClosedError

log = logging.getLogger(__name__)

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


class Hop:
    """The caller's handle on one forwarded exchange: :meth:`cut` closes the connection it is on
    (the client went away: the peer sees its client gone) and stops any resend."""

    def __init__(self) -> None:
        self.stream: IOStream | None = None
        self.cut_off = False

    def cut(self) -> None:
        self.cut_off = True
        if self.stream is not None:
            self.stream.close()


class _Watch(httputil.HTTPMessageDelegate):
    """Passes the response to the caller's delegate and notes how far it got."""

    def __init__(self, delegate: httputil.HTTPMessageDelegate) -> None:
        self.delegate = delegate
        self.answered = False  # the peer's status line came: the request reached it
        self.finished = False
        self.keep_alive = False

    def headers_received(
        self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine, headers: httputil.HTTPHeaders
    ) -> Any:
        assert isinstance(start_line, httputil.ResponseStartLine)
        self.answered = True
        self.keep_alive = start_line.version == "HTTP/1.1" and (headers.get("Connection") or "").lower() != "close"
        return self.delegate.headers_received(start_line, headers)

    def data_received(self, chunk: bytes) -> Any:
        return self.delegate.data_received(chunk)

    def finish(self) -> None:
        self.finished = True
        self.delegate.finish()

    def on_connection_close(self) -> None:
        self.delegate.on_connection_close()


@dataclasses.dataclass
class _Idle:
    stream: IOStream
    until: float  # time.monotonic() after which it is not lent any more


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
        self.max_idle_per_peer = max_idle_per_peer
        self.idle_seconds = idle_seconds
        # No header or body timeout here (each is a timer per read): one timer bounds the exchange.
        self.params = HTTP1ConnectionParameters(
            max_header_size=MAX_HEADER_BYTES, max_body_size=max_response_bytes, decompress=False
        )
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
        headers: httputil.HTTPHeaders,
        body: bytes | None,
        delegate: httputil.HTTPMessageDelegate,
        hop: Hop,
    ) -> None:
        """Send ``method target`` with ``headers`` (end-to-end ones; Host and Content-Length are
        added here) and ``body`` (None: no body) to the peer at ``url``; the response goes to
        ``delegate`` as it is read. Returns once the whole response was read. Raises
        ConnectionError (the cause chained) when the peer cannot be reached, closes mid-way, sends
        a malformed or over-limit answer, or times out; the delegate was then told
        ``on_connection_close`` if its headers had come."""
        peer = self._peers.get(url) or self._peers.setdefault(url, Peer.of(url))
        headers = httputil.HTTPHeaders(headers)
        headers["Host"] = peer.netloc
        if body is not None:
            headers["Content-Length"] = str(len(body))
        start = httputil.RequestStartLine(method, target, "HTTP/1.1")
        for attempt in (1, 2):
            stream, reused = await self._check_out(peer, fresh=attempt > 1)
            hop.stream = stream
            if hop.cut_off:
                stream.close()
                raise ConnectionError("the client went away")
            watch = _Watch(delegate)
            sent = False
            failure: BaseException | None = None
            connection = HTTP1Connection(stream, True, self.params)
            # A peer that hangs without closing: the connection is closed (the read then fails).
            timer = asyncio.get_running_loop().call_later(self.request_timeout, _expire, stream)
            try:
                if stream.closed():
                    raise StreamClosedError(stream.error)
                sent = True  # handed to the socket (the write is fire-and-forget: a failure shows on the read)
                connection.write_headers(start, headers, body or None)
                connection.finish()
                await connection.read_response(watch)
            except (OSError, httputil.HTTPOutputError) as err:  # StreamClosedError is an OSError
                failure = err
            finally:
                timer.cancel()
            if watch.finished:
                if watch.keep_alive and not stream.closed():
                    self._check_in(peer, stream)
                else:
                    stream.close()
                return
            stream.close()
            resend = (
                reused
                and attempt == 1
                and not watch.answered
                and not hop.cut_off
                and (not sent or method in IDEMPOTENT_METHODS)
            )
            if not resend:
                reason = _reason(failure, stream) if watch.answered or failure else "the connection closed"
                raise ConnectionError(reason) from failure
            log.info("kept-alive connection to %s closed; %s %s sent again on a new one", peer.netloc, method, target)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the pool ----------------------------------------------------------------------------------

    async def _check_out(self, peer: Peer, *, fresh: bool) -> tuple[IOStream, bool]:
        """(a connection to ``peer``, whether it was kept from an earlier exchange)."""
        idle = self._idle.get(peer)
        if idle and not fresh:
            self._expire_idle(idle)
        while idle and not fresh:
            entry = idle.pop()
            stream = entry.stream
            stream.set_close_callback(None)
            if _still_open(stream):
                self.reused += 1
                return stream, True
            stream.close()
        return await self._connect(peer), False

    def _check_in(self, peer: Peer, stream: IOStream) -> None:
        """Keep ``stream`` for the next exchange with ``peer`` (closed if the pool is full)."""
        idle = self._idle.setdefault(peer, collections.deque())
        self._expire_idle(idle)
        if len(idle) >= self.max_idle_per_peer:
            stream.close()
            return
        idle.append(_Idle(stream, time.monotonic() + self.idle_seconds))
        # Listening for the peer's close while idle: the entry leaves the pool when it comes.
        stream.set_close_callback(lambda: self._drop(peer, stream))

    @staticmethod
    def _expire_idle(idle: collections.deque[_Idle]) -> None:
        """Close the connections idle past :attr:`idle_seconds` (the oldest are on the left).
        Done as the pool is used, not on a timer per connection: one that is never asked for
        again is closed by its peer's own idle limit, and leaves the pool then."""
        now = time.monotonic()
        while idle and idle[0].until <= now:
            entry = idle.popleft()
            entry.stream.set_close_callback(None)
            entry.stream.close()

    def _drop(self, peer: Peer, stream: IOStream) -> None:
        """An idle connection the peer closed: out of the pool."""
        idle = self._idle.get(peer)
        if idle:
            for entry in idle:
                if entry.stream is stream:
                    idle.remove(entry)
                    break
        stream.set_close_callback(None)
        stream.close()

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
                entry.stream.set_close_callback(None)
                entry.stream.close()

    # -- opening connections -----------------------------------------------------------------------

    async def _connect(self, peer: Peer) -> IOStream:
        """A new connection (TCP_NODELAY; TLS for https), within the connect timeout. Raises
        OSError (a StreamClosedError or TimeoutError among them) naming what failed."""
        last: BaseException | None = None
        for family, address in await self._resolve(peer):
            stream = IOStream(socket.socket(family, socket.SOCK_STREAM))
            try:
                await gen.with_timeout(
                    datetime.timedelta(seconds=self.connect_timeout),
                    stream.connect(address),
                    quiet_exceptions=(StreamClosedError,),
                )
                if peer.scheme == "https":
                    stream = await stream.start_tls(False, self._tls_context(), server_hostname=peer.host)
            except (OSError, gen.TimeoutError) as err:
                stream.close()
                last = stream.error or err
                continue
            stream.set_nodelay(True)
            self.opened += 1
            return stream
        if isinstance(last, gen.TimeoutError | asyncio.TimeoutError):
            raise ConnectionError(f"no connection within {self.connect_timeout:g} s") from last
        raise ConnectionError(_reason(last, None)) from last

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
            raise ConnectionError(f"cannot resolve {peer.host}: {err}") from err
        addresses = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
        self._addresses[key] = (time.monotonic() + RESOLVE_CACHE_SECONDS, addresses)
        return addresses

    def _tls_context(self) -> ssl.SSLContext:
        """Certificates verified, as tornado's client does by default (built once: it reads the CA store)."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


def _expire(stream: IOStream) -> None:
    """The exchange's time is up: close its connection (its read fails: the caller's 503)."""
    stream.close(TimeoutError("no answer within the request timeout"))


def _still_open(stream: IOStream) -> bool:
    """Whether an idle connection can carry a request: not closed, no close (or stray bytes)
    waiting to be read. A non-blocking peek on the raw socket: nothing waits."""
    if stream.closed():
        return False
    try:
        socket.socket.recv(stream.socket, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # type: ignore[arg-type]
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False  # b"": the peer closed it; bytes: an answer nobody asked for. Either way, not reusable.


def _reason(err: BaseException | None, stream: IOStream | None) -> str:
    """A short why for a failed exchange (its message goes into the 503)."""
    if isinstance(err, StreamClosedError) and err.real_error is not None:
        err = err.real_error
    elif err is None and stream is not None and stream.error is not None:
        err = stream.error
    if err is None:
        return "the connection closed before the answer was complete"
    if isinstance(err, gen.TimeoutError | asyncio.TimeoutError):
        return "timed out"
    return str(err) or type(err).__name__
