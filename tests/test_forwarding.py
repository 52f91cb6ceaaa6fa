"""Forwarding between the gateways of a cluster (issue 18): any gateway answers for any session.

The signature tests are pure. The end-to-end ones run two real ``sandkernel serve`` processes on
this machine's one Docker engine (different state dirs, ports and host ids, one PostgreSQL
catalog from tests/postgres_fixtures.py, one cluster secret, one tokens file; runc, no warm
pool): a session created through A is used through B (JSON and NDJSON execute, the kernel
websocket, a file up and down), another tenant gets 404 through either, a forged or stale
forwarded header is a 401, and with the owner killed B answers 503 naming the host while it
keeps serving its own sessions.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tornado import httputil, web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.httpserver import HTTPServer
from tornado.iostream import IOStream
from tornado.netutil import bind_sockets
from tornado.websocket import websocket_connect

from sandkernel.errors import ConfigError
from sandkernel.gateway.cluster.peer_pool import Hop, PeerPool
from sandkernel.gateway.cluster.signing import (
    FORWARDED_HEADER,
    PLACE_HERE_HEADER,
    load_cluster_secret,
    sign,
)
from sandkernel.gateway.http_api import MAX_BODY_BYTES
from sandkernel.gateway.kernels_api import recorded_kernel_model
from sandkernel.gateway.managed import record_model
from sandkernel.kernels.model.records import SandboxRecord

from .conftest import container_ids_of, require_runtime
from .gateway_fixtures import ALICE, BOB, OPERATOR, call_api, free_port, refusing_port
from .kernel_websocket import run_cell
from .postgres_fixtures import create_database, drop_database, postgres_server  # noqa: F401 (pytest finds it here)
from .test_durable_sessions import Serve

pytestmark = pytest.mark.docker

SECRET = b"s" * 40
CLUSTER_SECRET = b"cluster-secret-for-the-forwarding-tests-0123456789"
URI = "/api/sessions/abc/execute?stream=1"


def write_secret(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


# -- the cluster secret file ----------------------------------------------------------------


def test_a_good_secret_file_is_read_without_its_newline(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "secret", SECRET + b"\n")
    assert load_cluster_secret(path) == SECRET


@pytest.mark.parametrize(
    ("data", "mode", "words"),
    [
        (None, 0o600, "cannot read"),
        (SECRET, 0o644, "chmod 600"),
        (SECRET, 0o640, "chmod 600"),
        (b"x" * 31, 0o600, "at least 32"),
        (b"   \n", 0o600, "at least 32"),
    ],
    ids=["missing", "world-readable", "group-readable", "short", "blank"],
)
def test_a_bad_secret_file_is_refused_with_what_to_do(
    tmp_path: Path, data: bytes | None, mode: int, words: str
) -> None:
    path = tmp_path / "secret"
    if data is not None:
        write_secret(path, data, mode)
    with pytest.raises(ConfigError, match=words) as caught:
        load_cluster_secret(path)
    assert SECRET.decode() not in str(caught.value)  # the secret itself is never echoed


# -- what a gateway says of another host's live session (from its catalog record) ------------


@pytest.mark.parametrize(("running", "state"), [({"code": "1+1", "started_at": 1.0}, "busy"), (None, "idle")])
def test_the_sessions_and_kernels_apis_say_the_same_of_another_hosts_kernel(running, state):
    record = SandboxRecord("s1", "session", {"kernel_id": "k1"}, tenant="alice", running=running,
                           gateway={"kernel_name": "python3-sandkernel", "last_activity": "2026-12-02T00:00:00Z"})  # fmt: skip
    session = record_model(record)
    assert session["state"] == "running" and session["kernel"]["execution_state"] == state
    assert recorded_kernel_model(record) == session["kernel"]
    assert session["kernel"]["id"] == "k1" and session["kernel"]["connections"] == 0


# -- the peer pool: kept-alive connections to another gateway (real tornado servers, loopback) ----


class Counted(HTTPServer):
    """A tornado HTTP server that counts the connections it accepted (and lets a test wait for one)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accepted = 0

    def handle_stream(self, stream: IOStream, address: Any) -> None:
        self.accepted += 1
        super().handle_stream(stream, address)


class Peer:
    """An in-process gateway stand-in: /echo answers the method and body; /stream writes one line,
    then a second once the test says so (``go``)."""

    def __init__(self, idle_seconds: float | None = None) -> None:
        self.go = asyncio.Event()
        go = self.go

        class Echo(web.RequestHandler):
            def post(self) -> None:
                self.write({"method": "POST", "body": self.request.body.decode()})

            def get(self) -> None:
                self.write({"method": "GET", "body": ""})

        class Stream(web.RequestHandler):
            async def get(self) -> None:
                self.set_header("Content-Type", "application/x-ndjson")
                self.write('{"n": 1}\n')
                await self.flush()
                await asyncio.wait_for(go.wait(), 30)
                self.write('{"n": 2}\n')

        app = web.Application([("/echo", Echo), ("/stream", Stream)])
        self.server = Counted(app, idle_connection_timeout=idle_seconds)
        sockets = bind_sockets(0, "127.0.0.1")
        self.server.add_sockets(sockets)
        self.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.stop()


class Collect(httputil.HTTPMessageDelegate):
    """A response as the pool hands it over; ``on_chunk`` runs as each chunk arrives."""

    def __init__(self, on_chunk: Any = None) -> None:
        self.code = 0
        self.chunks: list[bytes] = []
        self.on_chunk = on_chunk

    def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> None:
        self.code = start_line.code

    async def data_received(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        if self.on_chunk is not None:
            await self.on_chunk(chunk)

    @property
    def json(self) -> Any:
        return json.loads(b"".join(self.chunks))


def new_pool(**kw: Any) -> PeerPool:
    return PeerPool(connect_timeout=5, request_timeout=60, max_response_bytes=1 << 20, **kw)


async def fetch(pool: PeerPool, url: str, method: str = "POST", path: str = "/echo", body: bytes | None = b"x",
                delegate: Collect | None = None) -> Collect:  # fmt: skip
    delegate = delegate or Collect()
    await pool.fetch(url, method, path, httputil.HTTPHeaders(), body, delegate, Hop())
    return delegate


async def test_forwarded_requests_to_one_peer_share_one_kept_alive_connection():
    peer, pool = Peer(), new_pool()
    try:
        for i in range(5):
            answer = await fetch(pool, peer.url, body=f"call {i}".encode())
            assert answer.code == 200 and answer.json == {"method": "POST", "body": f"call {i}"}
        assert peer.server.accepted == 1 and pool.opened == 1 and pool.reused == 4
        assert pool.idle_count(peer.url) == 1
        # Concurrent ones each need a connection; afterwards the pool keeps at most its cap.
        small = new_pool(max_idle_per_peer=2)
        answers = await asyncio.gather(*(fetch(small, peer.url, body=f"c{i}".encode()) for i in range(4)))
        assert [a.json["body"] for a in answers] == ["c0", "c1", "c2", "c3"]  # each answer is its own request's
        assert small.opened == 4 and small.idle_count(peer.url) == 2
        # Many more, on the two kept connections and new ones: still no answer crosses to another request.
        answers = await asyncio.gather(*(fetch(small, peer.url, body=f"d{i}".encode()) for i in range(40)))
        assert [a.json["body"] for a in answers] == [f"d{i}" for i in range(40)] and small.reused >= 2
        small.close()
        assert small.idle_count(peer.url) == 0
    finally:
        pool.close()
        peer.stop()


async def test_a_kept_connection_the_peer_closed_when_idle_is_not_used_again():
    peer, pool = Peer(idle_seconds=0.3), new_pool()  # the peer closes idle connections after 0.3 s
    try:
        assert (await fetch(pool, peer.url)).code == 200
        assert pool.idle_count(peer.url) == 1
        deadline = time.monotonic() + 10
        while pool.idle_count(peer.url):  # the peer's close reaches the idle stream, which leaves the pool
            assert time.monotonic() < deadline, "the pool kept a connection its peer closed"
            await asyncio.sleep(0.05)
        answer = await fetch(pool, peer.url, body=b"after the close")
        assert answer.code == 200 and answer.json["body"] == "after the close"
        assert peer.server.accepted == 2 and pool.opened == 2
    finally:
        pool.close()
        peer.stop()


async def test_an_idle_connection_is_closed_by_the_pool_after_its_idle_time():
    peer, pool = Peer(), new_pool(idle_seconds=0.2)
    try:
        assert (await fetch(pool, peer.url)).code == 200
        deadline = time.monotonic() + 10
        while pool.idle_count(peer.url):
            assert time.monotonic() < deadline, "the pool kept an idle connection past its idle time"
            await asyncio.sleep(0.05)
        assert (await fetch(pool, peer.url)).code == 200 and peer.server.accepted == 2
    finally:
        pool.close()
        peer.stop()


class Dropping:
    """A scripted peer on a real socket: it answers the first request of each connection (kept
    alive), and closes the connection on the second without answering, as a peer does when a
    kept-alive connection's close races a request. ``requests`` counts what it received."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.connections = 0

    async def start(self) -> Dropping:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(httputil.HTTPHeaders.parse(head.decode().split("\r\n", 1)[1])
                                         .get("Content-Length", "0")))  # fmt: skip
            self.requests.append(head.split(b" ", 2)[0])
            writer.write(self.ANSWER)
            await writer.drain()
            second = await reader.readuntil(b"\r\n\r\n")
            self.requests.append(second.split(b" ", 2)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def test_a_request_lost_on_a_reused_connection_is_resent_once_only_if_idempotent():
    peer = await Dropping().start()
    pool = new_pool()
    try:
        assert (await fetch(pool, peer.url, "GET", body=None)).code == 200
        # The kept connection is dropped under the GET: it goes again on a new connection.
        answer = await fetch(pool, peer.url, "GET", body=None)
        assert answer.code == 200 and peer.requests == [b"GET", b"GET", b"GET"] and peer.connections == 2
        # A POST (an execute) that may have reached the peer is never sent twice: the caller's 503.
        with pytest.raises(ConnectionError):
            await fetch(pool, peer.url, "POST", body=b"1+1")
        assert peer.requests == [b"GET", b"GET", b"GET", b"POST"] and peer.connections == 2
    finally:
        pool.close()
        await peer.stop()


async def test_a_peer_that_cannot_be_reached_is_a_connection_error_and_nothing_is_kept():
    pool = new_pool()
    with refusing_port() as port, pytest.raises(ConnectionError, match="refused"):
        await fetch(pool, f"http://127.0.0.1:{port}")
    assert pool.opened == 0


async def test_a_peer_that_stops_answering_mid_way_is_cut_at_the_request_timeout():
    peer = Peer()
    pool = PeerPool(connect_timeout=5, request_timeout=0.5, max_response_bytes=1 << 20)
    answer = Collect()
    try:
        with pytest.raises(ConnectionError, match="timed out"):  # /stream holds its second line
            await asyncio.wait_for(fetch(pool, peer.url, "GET", "/stream", None, answer), 30)
        assert answer.chunks == [b'{"n": 1}\n'] and pool.idle_count(peer.url) == 0
    finally:
        peer.go.set()
        pool.close()
        peer.stop()


async def test_a_streamed_answer_reaches_the_caller_chunk_by_chunk(monkeypatch):
    peer, pool = Peer(), new_pool()

    async def first_then_release(chunk: bytes) -> None:
        # The first line is here while the peer still holds the second: nothing was buffered.
        peer.go.set()

    # An IP-literal peer is connected to as is: no name resolution (getaddrinfo runs in a thread).
    async def no_resolver(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an IP-literal peer was resolved")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_resolver)
    try:
        answer = await asyncio.wait_for(fetch(pool, peer.url, "GET", "/stream", None, Collect(first_then_release)), 30)
        assert answer.code == 200 and answer.chunks == [b'{"n": 1}\n', b'{"n": 2}\n']
        assert pool.idle_count(peer.url) == 1  # a chunked answer read to its end leaves the connection reusable
    finally:
        pool.close()
        peer.stop()


async def test_a_cut_mid_answer_closes_the_hop_and_a_late_cut_leaves_a_kept_connection_alone():
    peer, pool = Peer(), new_pool()
    try:
        hop = Hop()

        async def cut_after_first(chunk: bytes) -> None:
            hop.cut()  # the client went away after the first line

        answer = Collect(cut_after_first)
        with pytest.raises(ConnectionError, match="went away"):
            await asyncio.wait_for(
                pool.fetch(peer.url, "GET", "/stream", httputil.HTTPHeaders(), None, answer, hop), 30
            )
        assert answer.chunks == [b'{"n": 1}\n'] and pool.idle_count(peer.url) == 0
        # An exchange that finished: its hop no longer reaches the connection, now kept for others.
        done = Hop()
        await pool.fetch(peer.url, "GET", "/echo", httputil.HTTPHeaders(), None, Collect(), done)
        assert pool.idle_count(peer.url) == 1
        done.cut()
        assert pool.idle_count(peer.url) == 1 and (await fetch(pool, peer.url)).code == 200 and pool.reused == 1
    finally:
        peer.go.set()
        pool.close()
        peer.stop()


async def test_an_https_peer_is_verified_against_the_trusted_cas_and_its_connection_kept(tmp_path, monkeypatch):
    """Gateways that serve HTTPS (--certfile) are reached over TLS, the certificate checked as
    Python's default context does (SSL_CERT_FILE: the cluster's CA), the connection kept."""
    import ssl

    from .certificates import make_certificates

    trusted, stranger = make_certificates(tmp_path / "trusted"), make_certificates(tmp_path / "stranger")
    monkeypatch.setenv("SSL_CERT_FILE", str(trusted.ca))
    servers, urls = [], []
    for certificates in (trusted, stranger):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(certificates.cert, certificates.key)
        peer = Peer()
        peer.server.stop()  # the same app, served over TLS instead
        server = Counted(peer.server.request_callback, ssl_options=context)
        sockets = bind_sockets(0, "127.0.0.1")
        server.add_sockets(sockets)
        servers.append((peer, server))
        urls.append(f"https://127.0.0.1:{sockets[0].getsockname()[1]}")
    pool = new_pool()
    try:
        for i in range(3):
            answer = await fetch(pool, urls[0], body=f"tls {i}".encode())
            assert answer.code == 200 and answer.json == {"method": "POST", "body": f"tls {i}"}
        assert servers[0][1].accepted == 1 and pool.opened == 1 and pool.reused == 2
        with pytest.raises(ConnectionError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await fetch(pool, urls[1])
        assert pool.idle_count(urls[1]) == 0
    finally:
        pool.close()
        for peer, server in servers:
            peer.go.set()
            server.stop()


class Scripted:
    """A peer on a real socket that answers each request with the bytes a test gives (as the
    owner's gateway would write them, or worse), then keeps the connection open (or closes it
    after the last answer: ``close``)."""

    def __init__(self, *answers: bytes, close: bool = False) -> None:
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.close = close

    async def start(self) -> Scripted:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(httputil.HTTPHeaders.parse(head.decode().split("\r\n", 1)[1]).get("Content-Length", "0"))
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.answers.pop(0))
                await writer.drain()
            if not self.close:
                await reader.read()  # until the pool closes it
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def test_the_request_goes_out_as_one_message_with_host_and_length():
    peer = await Scripted(b"HTTP/1.1 204 No Content\r\n\r\n").start()
    pool = new_pool()
    try:
        headers = httputil.HTTPHeaders({"Authorization": "token t", "X-Sandkernel-Forwarded": "host=a;t=1;sig=00"})
        answer = Collect()
        await pool.fetch(peer.url, "POST", "/api/x?stream=1", headers, b'{"code": "1+1"}', answer, Hop())
        assert answer.code == 204 and answer.chunks == []
        head, _, body = peer.requests[0].partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        assert lines[0] == "POST /api/x?stream=1 HTTP/1.1" and body == b'{"code": "1+1"}'
        assert set(lines[1:]) == {
            f"Host: {peer.url.removeprefix('http://')}", "Authorization: token t",
            "X-Sandkernel-Forwarded: host=a;t=1;sig=00", "Content-Length: 15",
        }  # fmt: skip
        with pytest.raises(ValueError, match="line break"):  # a value set around tornado's check
            bad = httputil.HTTPHeaders()
            bad["X-Evil"] = "a\r\nX-Injected: 1"
            await pool.fetch(peer.url, "GET", "/", bad, None, Collect(), Hop())
    finally:
        pool.close()
        await peer.stop()


async def test_a_chunked_answer_is_unframed_extensions_and_trailers_dropped_and_the_connection_kept():
    chunked = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'9;ext=1\r\n{"n": 1}\n\r\n9\r\n{"n": 2}\n\r\n0\r\nX-Trailer: t\r\n\r\n'
    )
    peer = await Scripted(
        chunked, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    ).start()
    pool = new_pool()
    try:
        answer = await fetch(pool, peer.url, "GET", "/stream", None)
        assert answer.code == 200 and answer.chunks == [b'{"n": 1}\n', b'{"n": 2}\n']
        answer = await fetch(pool, peer.url, "GET", "/after", None)  # the interim 100 is skipped
        assert answer.code == 200 and answer.chunks == [b"ok"] and pool.opened == 1 and pool.reused == 1
    finally:
        pool.close()
        await peer.stop()


async def test_repeated_headers_and_latin1_values_of_an_answer_come_through():
    answer = (
        b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX-Name: caf\xe9\tau lait \r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    peer = await Scripted(answer).start()
    pool = new_pool()
    try:
        got: list[httputil.HTTPHeaders] = []

        class Headers(Collect):
            def headers_received(self, start_line: Any, headers: httputil.HTTPHeaders) -> None:
                got.append(headers)

        await fetch(pool, peer.url, "GET", "/", None, Headers())
        assert got[0].get_list("Set-Cookie") == ["a=1", "b=2"] and got[0]["X-Name"] == "caf\xe9\tau lait"
    finally:
        pool.close()
        await peer.stop()


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", "over the limit"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100001\r\n", "over the limit"),
        (b"HTTP/1.1 200 OK\r\nBad Header\r\nContent-Length: 0\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\nContent-Length: 0\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "unsupported framing"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX", "does not end with CRLF"),
        (b"SMTP ready\r\n\r\n", "start line"),
    ],
    ids=[
        "length-over",
        "chunks-over",
        "no-colon",
        "folded",
        "control-char",
        "bad-length",
        "gzip",
        "bad-size",
        "chunk-end",
        "not-http",
    ],
)
async def test_a_malformed_or_oversized_answer_is_a_connection_error_and_the_connection_dropped(answer, words):
    peer = await Scripted(answer).start()
    pool = new_pool()  # answers up to 1 MiB
    try:
        with pytest.raises(ConnectionError, match=words):
            await asyncio.wait_for(fetch(pool, peer.url, "GET", "/", None), 30)
        assert pool.idle_count(peer.url) == 0
    finally:
        pool.close()
        await peer.stop()


async def test_an_answer_that_ends_with_the_connection_is_whole_and_the_connection_not_kept():
    peer = await Scripted(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it", close=True).start()
    pool = new_pool()
    try:
        answer = await asyncio.wait_for(fetch(pool, peer.url, "GET", "/", None), 30)
        assert answer.code == 200 and b"".join(answer.chunks) == b"all of it" and pool.idle_count(peer.url) == 0
    finally:
        pool.close()
        await peer.stop()


async def answer_when_whole(pool: PeerPool, exchange: Any, hop: Hop) -> Any:
    """What :meth:`PeerPool.answer_now` gives, asked each time the connection reports something
    (as the fast lane asks); None once the head came and the answer is not one it takes whole."""
    news = asyncio.Event()
    exchange.connection.on_answer = news.set
    while True:
        await asyncio.wait_for(news.wait(), 30)
        news.clear()
        whole = pool.answer_now(exchange, hop)
        if whole is not None or not exchange.head_pending:
            return whole


async def test_a_request_is_sent_at_once_on_a_kept_connection_and_a_short_answer_taken_whole():
    """send_now writes the request without awaiting (the fast lane's hot path) when the pool
    keeps an idle connection, and answer_now takes a Content-Length answer whole out of the
    connection's buffer, the connection going back to the pool."""
    peer, pool = Peer(), new_pool()
    try:
        assert pool.send_now(peer.url, "POST", "/echo", [], b"x", Hop()) is None  # nothing kept yet
        assert (await fetch(pool, peer.url)).code == 200
        for i in range(3):
            hop = Hop()
            exchange = pool.send_now(peer.url, "POST", "/echo", [("X-Call", str(i))], f"now {i}".encode(), hop)
            assert exchange is not None and exchange.reused and pool.idle_count(peer.url) == 0
            whole = await answer_when_whole(pool, exchange, hop)
            assert whole is not None and whole.start_line.code == 200, whole
            assert json.loads(whole.body) == {"method": "POST", "body": f"now {i}"}
            assert whole.headers["Content-Type"].startswith("application/json")
            assert exchange.connection.on_answer is None and pool.idle_count(peer.url) == 1
        assert peer.server.accepted == 1 and pool.opened == 1 and pool.reused == 3
    finally:
        pool.close()
        peer.stop()


async def test_a_request_that_cannot_be_written_leaves_the_kept_connection_in_the_pool():
    peer, pool = Peer(), new_pool()
    try:
        await fetch(pool, peer.url)
        with pytest.raises(ValueError, match="line break"):
            pool.send_now(peer.url, "POST", "/echo", [("X-Bad", "a\r\nX-Smuggled: 1")], b"x", Hop())
        assert pool.idle_count(peer.url) == 1  # not lent for a request that never went
        assert (await fetch(pool, peer.url, body=b"next")).json["body"] == "next" and pool.opened == 1
    finally:
        pool.close()
        peer.stop()


async def test_an_answer_not_taken_whole_is_read_by_receive_as_it_streams():
    """A chunked (streamed) answer is not taken whole: answer_now says None once its head came,
    and receive reads it piece by piece from what is already there."""
    peer, pool = Peer(), new_pool()
    try:
        await fetch(pool, peer.url, "GET", "/echo", None)
        hop = Hop()
        exchange = pool.send_now(peer.url, "GET", "/stream", [], None, hop)
        assert exchange is not None
        assert await answer_when_whole(pool, exchange, hop) is None
        exchange.connection.on_answer = None

        async def second_line(chunk: bytes) -> None:
            peer.go.set()

        answer = Collect(on_chunk=second_line)
        await asyncio.wait_for(pool.receive(exchange, answer, hop), 30)
        assert b"".join(answer.chunks) == b'{"n": 1}\n{"n": 2}\n' and pool.idle_count(peer.url) == 1
    finally:
        pool.close()
        peer.stop()


# -- two real gateways, one catalog ----------------------------------------------------------


class Host:
    """One cluster gateway: a ``sandkernel serve`` process (tests/test_durable_sessions.py's
    Serve) with the cluster's flags."""

    def __init__(self, root: Path, host_id: str, catalog_url: str, secret_file: Path) -> None:
        self.host_id = host_id
        self.serve = Serve(root / host_id, "runc")
        self.flags = (
            "--catalog-url", catalog_url, "--cluster-secret-file", str(secret_file), "--host-id", host_id,
            "--advertise-url", self.serve.url, "--heartbeat-seconds", "1", "--on-exit", "delete",
        )  # fmt: skip

    @property
    def url(self) -> str:
        return self.serve.url

    def holds(self, model: dict[str, Any]) -> bool:
        """Whether this host holds the session: its transcript is in this host's notebook dir."""
        return str(model["path"]).startswith(str(self.serve.notebooks))

    async def start(self) -> Host:
        await self.serve.start(*self.flags)
        return self

    async def call(self, method: str, path: str, body: Any = None, token: str = ALICE,
                   headers: dict[str, str] | None = None, raw: bytes | None = None,
                   **kw: Any) -> tuple[int, Any, Any]:  # fmt: skip
        """(status, JSON or text, response headers) of one request."""
        return await call_api(self.url + path, method, body, token, raw=raw, headers=headers, request_timeout=120, **kw)


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory, request) -> AsyncIterator[tuple[Host, Host]]:
    """Two gateways of one cluster on this engine: host-a and host-b, each with its own state dir
    and port, one catalog database, one secret. Each stops with --on-exit delete."""
    require_runtime("runc")
    root = tmp_path_factory.mktemp("cluster")
    catalog_url = create_database(request.getfixturevalue("postgres_server").url())
    secret_file = write_secret(root / "cluster.secret", CLUSTER_SECRET)
    hosts = [Host(root, name, catalog_url, secret_file) for name in ("host-a", "host-b")]
    try:
        await asyncio.gather(*(host.start() for host in hosts))
        yield hosts[0], hosts[1]
    finally:
        for host in hosts:
            if host.serve.proc is not None and host.serve.proc.poll() is None:
                assert await host.serve.term() == 0, host.serve.output[-4000:]
        drop_database(catalog_url)


@pytest.fixture(scope="module")
async def placed(cluster: tuple[Host, Host]) -> dict[str, dict[str, Any]]:
    """Two of alice's sessions, both created through host-b: placement puts them on both hosts
    (each goes to the host with most room), so one create was forwarded to host-a (signed, with
    X-Sandkernel-Place-Here) and created there. Keyed by the host id that holds it."""
    a, b = cluster
    models = []
    for _ in range(2):
        status, model, _ = await b.call("POST", "/api/sessions", {"metadata": {"via": b.host_id}})
        assert status == 201, (status, model, b.serve.output[-4000:], a.serve.output[-4000:])
        assert model["metadata"] == {"via": b.host_id}
        models.append(model)
    by_host = {host.host_id: m for m in models for host in (a, b) if host.holds(m)}
    assert set(by_host) == {"host-a", "host-b"}, f"placement did not use both hosts: {[m['path'] for m in models]}"
    return by_host


def other(cluster: tuple[Host, Host], host_id: str) -> Host:
    """The gateway that does not hold a session of ``host_id``."""
    return next(host for host in cluster if host.host_id != host_id)


async def test_a_session_is_used_through_the_gateway_that_does_not_hold_it(cluster, placed):
    for owner_id, model in placed.items():
        via = other(cluster, owner_id)
        sid = model["id"]
        status, result, _ = await via.call("POST", f"/api/sessions/{sid}/execute", {"code": "x = 6 * 7; print(x)"})
        assert status == 200 and result["outputs"][0]["text"] == "42\n", (status, result)
        # The NDJSON stream comes through line by line, as the owner writes it.
        lines: list[tuple[float, bytes]] = []
        code = "import sys, time\nfor i in range(3):\n    sys.stdout.write(f'{i}\\n'); sys.stdout.flush(); time.sleep(0.4)"
        status, _, headers = await via.call(
            "POST", f"/api/sessions/{sid}/execute?stream=1", {"code": code},
            streaming_callback=lambda chunk, lines=lines: lines.append((time.monotonic(), chunk)),
        )  # fmt: skip
        assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
        events = [json.loads(line) for _, chunk in lines for line in chunk.splitlines() if line.strip()]
        assert [e["output"]["text"] for e in events if e["type"] == "output"] == ["0\n", "1\n", "2\n"]
        assert events[-1]["type"] == "result" and events[-1]["result"]["status"] == "ok"
        assert lines[-1][0] - lines[0][0] > 0.6, f"the stream was held back and sent at once: {lines}"
        # A file up through one gateway, down through it again: the owner's workspace has it.
        data = os.urandom(300_000)
        status, written, _ = await via.call("PUT", f"/api/sessions/{sid}/files/blob.bin", raw=data)
        assert status == 201 and written["size"] == len(data), written
        request = HTTPRequest(
            via.url + f"/api/sessions/{sid}/files/blob.bin", headers={"Authorization": f"token {ALICE}"}
        )
        download = await AsyncHTTPClient().fetch(request)
        assert download.body == data
        status, result, _ = await via.call(
            "POST", f"/api/sessions/{sid}/execute", {"code": "import os; print(os.path.getsize('blob.bin'), x)"}
        )
        assert result["outputs"][0]["text"] == f"{len(data)} 42\n", result


def connections_to(port: int) -> set[str]:
    """The TCP connections on this machine to ``port`` in any state (TIME_WAIT included, on
    whichever side closed first), each named by its other end's address as /proc/net/tcp{,6}
    lists it (the listening socket left out)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, remote = row.split()[1:3]
                local_port, remote_port = (int(end.rsplit(":", 1)[1], 16) for end in (local, remote))
                if remote_port == port:
                    found.add(local)
                elif local_port == port and remote_port:
                    found.add(remote)
    return found


async def test_forwarded_calls_reuse_one_kept_alive_connection_to_the_owner(cluster, placed):
    """The forwarding gateway keeps its connection to the owner: five forwarded executes open at
    most one new TCP connection to it (one per request, each left in TIME_WAIT, before the pool)."""
    owner = next(host for host in cluster if host.host_id == "host-a")
    via = other(cluster, "host-a")
    sid = placed["host-a"]["id"]
    before = connections_to(owner.serve.port)
    for i in range(5):
        status, result, _ = await via.call("POST", f"/api/sessions/{sid}/execute", {"code": f"print({i})"})
        assert status == 200 and result["outputs"][0]["text"] == f"{i}\n", (status, result)
    opened = connections_to(owner.serve.port) - before
    assert len(opened) <= 1, f"forwarding opened {len(opened)} connections to the owner for 5 calls: {opened}"


async def test_the_kernel_websocket_is_relayed_to_the_owner(cluster, placed):
    for owner_id, model in placed.items():
        via = other(cluster, owner_id)
        kernel_id = model["kernel"]["id"]
        status, kernel, _ = await via.call("GET", f"/api/kernels/{kernel_id}")
        assert status == 200 and kernel["id"] == kernel_id, (status, kernel)
        ws = await websocket_connect(
            HTTPRequest(
                via.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels",
                headers={"Authorization": f"token {ALICE}"},
            )
        )
        try:
            reply, text = await run_cell(ws, "print(40 + 3)")
            assert reply["status"] == "ok" and text == "43\n", (reply, text)
        finally:
            ws.close()


async def test_the_listing_is_cluster_wide_and_other_tenants_get_404_everywhere(cluster, placed):
    for host in cluster:
        status, listing, _ = await host.call("GET", "/api/sessions")
        assert status == 200
        assert {m["id"] for m in listing} == {m["id"] for m in placed.values()}, listing
        status, listing, _ = await host.call("GET", "/api/sessions", token=BOB)
        assert status == 200 and listing == []
    for model in placed.values():
        sid, kernel_id = model["id"], model["kernel"]["id"]
        for host in cluster:  # the owner and the other gateway answer bob the same
            for method, path, body in (
                ("GET", f"/api/sessions/{sid}", None),
                ("POST", f"/api/sessions/{sid}/execute", {"code": "x"}),
                ("GET", f"/api/sessions/{sid}/files/blob.bin", None),
                ("GET", f"/api/kernels/{kernel_id}", None),
            ):
                status, answer, _ = await host.call(method, path, body, token=BOB)
                assert status == 404 and answer["error"] == "not_found", (host.host_id, path, status, answer)
            with pytest.raises(HTTPClientError) as refused_ws:
                await websocket_connect(
                    HTTPRequest(
                        host.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels",
                        headers={"Authorization": f"token {BOB}"},
                    )
                )
            assert refused_ws.value.code == 404


async def test_a_forged_or_stale_forwarded_header_is_401_and_a_forwarded_request_is_not_forwarded_again(
    cluster, placed
):
    a, b = cluster
    sid = placed["host-a"]["id"]
    path = f"/api/sessions/{sid}"
    alice = f"token {ALICE}"
    replayed = sign(CLUSTER_SECRET, "GET", path, "host-b", credential=alice)
    status, _, _ = await a.call("GET", path, headers=replayed)
    assert status == 200
    cases = {
        "forged": {FORWARDED_HEADER: f"host=host-b;t={int(time.time())};n={'0' * 32};b={'0' * 64};sig={'0' * 64}"},
        "stale": sign(CLUSTER_SECRET, "GET", path, "host-b", credential=alice, now=time.time() - 120),
        "another secret": sign(b"w" * 40, "GET", path, "host-b", credential=alice),
        "another request": sign(CLUSTER_SECRET, "GET", f"/api/sessions/{placed['host-b']['id']}", "host-b"),
        "another credential": sign(CLUSTER_SECRET, "GET", path, "host-b", credential=f"token {BOB}"),
        "unsigned place-here": {PLACE_HERE_HEADER: "1"},
    }
    for name, headers in cases.items():
        for host in cluster:
            status, answer, _ = await host.call("GET", path, headers=headers)
            assert status == 401 and answer["error"] == "bad_forwarded_signature", (name, host.host_id, answer)
    # the one that was served once is refused the second time: its nonce was used
    status, answer, _ = await a.call("GET", path, headers=replayed)
    assert status == 401 and "used before" in answer["message"], answer
    # Signed properly, the owner serves it; the other gateway serves it itself too (no second hop):
    # it does not hold the session, so that is a 404, never a forward.
    status, model, _ = await a.call("GET", path, headers=sign(CLUSTER_SECRET, "GET", path, "host-b", credential=alice))
    assert status == 200 and model["id"] == sid
    headers = sign(CLUSTER_SECRET, "GET", path, "host-a", credential=alice)
    status, answer, _ = await b.call("GET", path, headers=headers)
    assert status == 404, (status, answer)
    # A forwarded execute whose body is not the one signed is refused before it runs.
    execute = f"{path}/execute"
    headers = sign(CLUSTER_SECRET, "POST", execute, "host-b", body=b'{"code": "1"}', credential=alice)
    status, answer, _ = await a.call("POST", execute, {"code": "open('/workspace/swapped', 'w')"}, headers=headers)
    assert status == 401 and "not the one 'host-b' signed" in answer["message"], answer
    status, reply, _ = await a.call("POST", execute, {"code": "import os; print(os.path.exists('/workspace/swapped'))"})
    assert status == 200 and reply["outputs"][0]["text"] == "False\n", reply


async def raw_request(host: Host, head: str | bytes, body: bytes = b"") -> socket.socket:
    """A request written on a plain socket (a client the test can cut off mid-answer)."""
    raw = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", host.serve.port))
    await asyncio.to_thread(raw.sendall, (head.encode() if isinstance(head, str) else head) + body)
    return raw


def execute_request(sid: str, code: str, query: str = "") -> tuple[bytes, bytes]:
    """(head, body) of a POST execute of ``code`` as alice, written by hand."""
    body = json.dumps({"code": code}).encode()
    head = (f"POST /api/sessions/{sid}/execute{query} HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    return head, body


async def test_a_client_that_goes_away_from_a_forwarded_stream_interrupts_its_code_on_the_owner(cluster, placed):
    """The forwarder cuts its hop when its client goes away, so the owner sees its client gone
    and interrupts the code (as it does for a client of its own: test_gateway.py)."""
    owner = next(host for host in cluster if host.host_id == "host-a")
    via = other(cluster, "host-a")
    sid = placed["host-a"]["id"]
    code = "import time\nprint('working', flush=True)\ntime.sleep(600)"
    raw = await raw_request(via, *execute_request(sid, code, "?stream=1"))
    received = b""
    while b"working" not in received:  # the code runs on the owner: its first line came through the hop
        chunk = await asyncio.wait_for(asyncio.to_thread(raw.recv, 4096), 60)
        assert chunk, f"stream closed early: {received!r}"
        received += chunk
    raw.close()
    deadline = time.monotonic() + 30
    while True:  # the owner's own view: its kernel idle again, long before the 600 s sleep ends
        status, model, _ = await owner.call("GET", f"/api/sessions/{sid}")
        if status == 200 and model["kernel"]["execution_state"] == "idle":
            break
        assert time.monotonic() < deadline, f"the owner's code ran on after the client went away: {model}"
        await asyncio.sleep(0.1)
    status, result, _ = await via.call("POST", f"/api/sessions/{sid}/execute", {"code": "print('free')"})
    assert status == 200 and result["outputs"][0]["text"] == "free\n", (status, result)
    status, notebook, _ = await owner.call("GET", f"/api/sessions/{sid}/notebook")
    statuses = [cell["metadata"]["sandkernel"]["status"] for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert statuses[-2:] == ["interrupted", "ok"], statuses


async def test_a_body_over_the_limit_is_a_413_from_the_forwarding_gateway(cluster, placed):
    via = other(cluster, "host-a")
    sid = placed["host-a"]["id"]
    path = f"/api/sessions/{sid}/files/big.bin"
    # Declared too large: refused before a byte of it is read.
    raw = await raw_request(
        via,
        f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n",
    )
    try:
        answer = await asyncio.wait_for(asyncio.to_thread(raw.recv, 65536), 30)
    finally:
        raw.close()
    assert answer.startswith(b"HTTP/1.1 413") and b'"too_large"' in answer, answer[:300]
    # No length given (chunked): refused once the limit is passed, and nothing reached the owner.
    reader, writer = await asyncio.open_connection("127.0.0.1", via.serve.port)
    writer.write(f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n".encode()
                 + b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    chunk = b"x" * (1 << 20)
    for _ in range(MAX_BODY_BYTES // len(chunk) + 1):  # just past the limit, then silence (no last chunk)
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    writer.close()  # (the rest can be cut by a reset: the gateway closes on an unread body)
    assert head.startswith(b"HTTP/1.1 413") and b"application/json" in head, head
    status, _, _ = await via.call("GET", path)
    assert status == 404


async def forwarded_counts(host: Host) -> dict[str, float]:
    """``sandkernel_forwarded_requests_total`` of a gateway, by the way taken (fast_lane, handler)."""
    status, text, _ = await host.call("GET", "/metrics", token=OPERATOR)
    assert status == 200, text
    found = re.findall(r'^sandkernel_forwarded_requests_total\{way="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {way: float(value) for way, value in found}


def counted_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {way: after.get(way, 0.0) - before.get(way, 0.0) for way in ("fast_lane", "handler")}


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """One Content-Length answer off a kept-alive connection: (status, JSON body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))
    body = await asyncio.wait_for(reader.readexactly(length), 60)
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_a_kept_alive_client_is_relayed_by_the_fast_lane_with_the_owners_answers(cluster, placed):
    """Plain requests for a session another host holds are relayed before tornado reads them (one
    kept-alive connection, a body sent in a second write too); anything else on the same
    connection (the owner's own session here) goes on through tornado, answered as before."""
    via = other(cluster, "host-a")
    sid, own = placed["host-a"]["id"], placed["host-b"]["id"]
    before = await forwarded_counts(via)
    reader, writer = await asyncio.open_connection("127.0.0.1", via.serve.port)
    try:
        for i in range(4):
            head, body = execute_request(sid, f"relayed = {i}; print(relayed * 2)")
            if i % 2:  # the body in a write of its own, a moment later
                writer.write(head)
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(body)
            else:
                writer.write(head + body)
            status, result = await read_answer(reader)
            assert status == 200 and result["outputs"][0]["text"] == f"{i * 2}\n", result
        middle = counted_since(before, await forwarded_counts(via))
        writer.write(f"GET /api/sessions/{own} HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n\r\n".encode())
        status, model = await read_answer(reader)
        assert status == 200 and model["id"] == own
        writer.write(f"GET /api/sessions/{sid} HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n\r\n".encode())
        status, model = await read_answer(reader)
        assert status == 200 and model["id"] == sid
    finally:
        writer.close()
    assert middle == {"fast_lane": 4.0, "handler": 0.0}, middle
    # tornado has the connection since the local request: the last one was forwarded by its handler
    assert counted_since(before, await forwarded_counts(via)) == {"fast_lane": 4.0, "handler": 1.0}


async def test_a_request_the_fast_lane_does_not_take_is_refused_or_served_by_tornado_and_nothing_is_smuggled(
    cluster, placed
):
    via = other(cluster, "host-a")
    owner = next(host for host in cluster if host.host_id == "host-a")
    sid = placed["host-a"]["id"]
    before = await forwarded_counts(via)
    inner = b"".join(execute_request(sid, "smuggled = 1"))
    outer = f"POST /api/sessions/{sid}/execute HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n"
    for name, head in {
        "length and chunked": outer + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n",
        "two lengths": outer + f"Content-Length: 5\r\nContent-Length: {5 + len(inner)}\r\n\r\n",
    }.items():
        raw = await raw_request(via, head, b"0\r\n\r\n" + inner)
        try:
            answer = await asyncio.wait_for(asyncio.to_thread(raw.recv, 65536), 30)
        finally:
            raw.close()
        assert answer.startswith(b"HTTP/1.1 400"), (name, answer[:300])
    status, result, _ = await owner.call("POST", f"/api/sessions/{sid}/execute", {"code": "print('smuggled' in dir())"})
    assert status == 200 and result["outputs"][0]["text"] == "False\n", result
    # A wrong token, and a query, go to tornado too: its 401, and its forward.
    status, _, _ = await via.call("GET", f"/api/sessions/{sid}", token="wrong-token")
    assert status == 401
    status, model, _ = await via.call("GET", f"/api/sessions/{sid}?detail=1")
    assert status == 200 and model["id"] == sid
    assert counted_since(before, await forwarded_counts(via)) == {"fast_lane": 0.0, "handler": 1.0}


async def test_a_client_that_goes_away_from_a_relayed_execute_is_no_harm(cluster, placed):
    """A JSON execute's client that goes away while its code runs on the owner: as with a client
    of the owner's own (only a stream interrupts on a disconnect), the code runs to its end there;
    the lane drops the hop and the answer, and its next relayed call is served."""
    owner = next(host for host in cluster if host.host_id == "host-a")
    via = other(cluster, "host-a")
    sid = placed["host-a"]["id"]
    before = await forwarded_counts(via)
    raw = await raw_request(via, *execute_request(sid, "import time\ntime.sleep(2); gone_client = 'ran to its end'"))
    deadline = time.monotonic() + 60
    while True:  # the code runs on the owner
        status, model, _ = await owner.call("GET", f"/api/sessions/{sid}")
        if model["kernel"]["execution_state"] == "busy":
            break
        assert time.monotonic() < deadline, model
        await asyncio.sleep(0.1)
    raw.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", via.serve.port)
    try:
        writer.write(b"".join(execute_request(sid, "print(gone_client)")))
        status, result = await read_answer(reader)  # after the first (one execution at a time)
    finally:
        writer.close()
    assert status == 200 and result["outputs"][0]["text"] == "ran to its end\n", result
    assert counted_since(before, await forwarded_counts(via)) == {"fast_lane": 2.0, "handler": 0.0}


async def test_a_large_answer_reaches_a_slow_client_whole_through_the_fast_lane(cluster, placed):
    """An answer larger than the lane takes whole (a transcript of a few MB) is written as the
    owner's pieces come; a client that reads slowly (its socket full) gets every byte, the same as
    the owner's own answer, and its next call on the connection is relayed too."""
    owner = next(host for host in cluster if host.host_id == "host-a")
    via = other(cluster, "host-a")
    sid = placed["host-a"]["id"]
    status, _, _ = await via.call("POST", f"/api/sessions/{sid}/execute", {"code": "print('x' * 3_000_000)"})
    assert status == 200
    status, expected, _ = await owner.call("GET", f"/api/sessions/{sid}/notebook", raw=None)
    assert status == 200
    before = await forwarded_counts(via)
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small: the lane's writes fill it
    await asyncio.to_thread(raw.connect, ("127.0.0.1", via.serve.port))
    request = f"GET /api/sessions/{sid}/notebook HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n\r\n"
    try:
        raw.sendall(request.encode())
        await asyncio.sleep(1)  # the owner's answer waits in the lane's buffers and the sockets'
        received = b""
        while b"\r\n\r\n" not in received or len(received) < received.index(b"\r\n\r\n") + 4 + int(
            re.search(rb"(?im)^content-length: *(\d+)", received).group(1)  # type: ignore[union-attr]
        ):
            chunk = await asyncio.wait_for(asyncio.to_thread(raw.recv, 65536), 60)
            assert chunk, f"closed after {len(received)} bytes"
            received += chunk
            if len(received) < 1_000_000:
                await asyncio.sleep(0.001)  # slowly, for the first MB
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert json.loads(body)["cells"] == expected["cells"]
        raw.sendall(request.encode())  # the connection is kept: the next call is relayed too
        again = await asyncio.wait_for(asyncio.to_thread(raw.recv, 65536), 60)
        assert again.startswith(b"HTTP/1.1 200"), again[:200]
    finally:
        raw.close()
    assert counted_since(before, await forwarded_counts(via)) == {"fast_lane": 2.0, "handler": 0.0}


async def test_an_mcp_call_naming_another_hosts_session_is_answered_by_that_host(cluster, placed):
    """The MCP door in a cluster: a modern MCP request (the SDK client's default) that names a
    session another host holds (a tool's ``session_id``, the notebook resource) is forwarded to
    that host's /mcp, signed, and its answer comes back as the client expects; another tenant
    naming it gets what an unknown id gets, and nothing is forwarded for it."""
    from .test_mcp_http import MODERN, mcp_client, run, text_of

    owner = next(host for host in cluster if host.host_id == "host-a")
    via = other(cluster, "host-a")
    sid = placed["host-a"]["id"]
    before = await forwarded_counts(via)
    async with mcp_client(via.serve, MODERN) as client:  # type: ignore[arg-type]
        result = await run(client, "through_mcp = 6\nprint(through_mcp * 7)", sid)
        assert not result.is_error and text_of(result).strip().startswith("42"), text_of(result)
        read = await client.read_resource(f"sandkernel://sessions/{sid}/notebook")
        cells = json.loads(read.contents[0].text)["cells"]  # type: ignore[union-attr]
        assert "through_mcp = 6" in "".join(cells[-1]["source"]), cells[-1]
        listed = await client.call_tool("list_sessions", {})  # the tenant's, on both hosts
        states = {s["session_id"]: s["state"] for s in listed.structured_content["sessions"]}  # type: ignore[index]
        assert states.get(sid) in ("idle", "busy") and placed["host-b"]["id"] in states, states
    async with mcp_client(via.serve, MODERN, token=BOB) as client:  # type: ignore[arg-type]
        result = await run(client, "print('bob was here')", sid)
        assert result.is_error and "bob was here" not in text_of(result), text_of(result)
        listed = await client.call_tool("list_sessions", {})
        assert sid not in text_of(listed), text_of(listed)
    assert counted_since(before, await forwarded_counts(via)) == {"fast_lane": 0.0, "handler": 2.0}
    status, notebook, _ = await owner.call("GET", f"/api/sessions/{sid}/notebook")
    assert status == 200, notebook
    sources = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert sources[-1].startswith("through_mcp = 6") and not any("bob" in src for src in sources), sources[-3:]
    assert notebook["cells"][-1]["metadata"]["sandkernel"]["source"] == "mcp", notebook["cells"][-1]["metadata"]


def peers_held(pid: int, port: int) -> set[int]:
    """Client ports of the TCP connections to ``port`` that process ``pid`` still holds open.

    Exactly the connections asked about, not a count of every descriptor: a gateway opens and
    closes others on its own (catalog, Docker, peers) while a test watches."""
    held = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:  # closed while listed
            continue
        if target.startswith("socket:["):
            held.add(target[len("socket:[") : -1])
    peers = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if int(local.rsplit(":", 1)[1], 16) == port and inode in held:
                peers.add(int(remote.rsplit(":", 1)[1], 16))
    return peers


async def test_a_body_that_stops_coming_is_never_relayed_and_its_connection_is_let_go(cluster, placed, tmp_path):
    """The fast lane reads a body that comes after its head as it comes: one that stops is
    relayed neither early nor late; the lane closes its connection at the idle time (a third
    gateway here, with --header-timeout 2), or when the client goes away, and keeps serving."""
    owner = next(host for host in cluster if host.host_id == "host-a")
    sid = placed["host-a"]["id"]
    catalog_url, secret_file = owner.flags[1], Path(owner.flags[3])
    impatient = Host(tmp_path, "host-c", catalog_url, secret_file)
    impatient.flags += ("--header-timeout", "2")
    await impatient.start()
    try:
        assert impatient.serve.proc is not None
        pid = impatient.serve.proc.pid
        status, result, _ = await impatient.call("POST", f"/api/sessions/{sid}/execute", {"code": "print(1)"})
        assert status == 200, result  # warm: the owner is cached and a kept connection to it open
        before, port = await forwarded_counts(impatient), impatient.serve.port
        head, body = execute_request(sid, "stalled = 1")
        idle = await raw_request(impatient, head, body[:5])  # the rest never comes
        gone = await raw_request(impatient, head, body[:5])
        stalled = {idle.getsockname()[1], gone.getsockname()[1]}
        deadline = time.monotonic() + 10
        while peers_held(pid, port) & stalled != stalled:  # the lane has taken both
            assert time.monotonic() < deadline, f"{peers_held(pid, port)} held, {stalled} sent"
            await asyncio.sleep(0.05)
        began = time.monotonic()
        gone.close()  # the other goes away mid-body
        closed = await asyncio.wait_for(asyncio.to_thread(idle.recv, 65536), 30)
        assert closed == b"" and 1.0 < time.monotonic() - began < 20, closed[:300]  # no answer: closed
        idle.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", impatient.serve.port)
        try:
            writer.write(b"".join(execute_request(sid, "print('stalled' in dir())")))
            status, result = await read_answer(reader)
        finally:
            writer.close()
        assert status == 200 and result["outputs"][0]["text"] == "False\n", result  # neither ran
        assert counted_since(before, await forwarded_counts(impatient)) == {"fast_lane": 1.0, "handler": 0.0}
        deadline = time.monotonic() + 10
        while peers_held(pid, port) & stalled:  # both stalled connections are closed on the lane's side too
            assert time.monotonic() < deadline, f"{peers_held(pid, port) & stalled} still held"
            await asyncio.sleep(0.1)
    finally:
        assert await impatient.serve.term() == 0, impatient.serve.output[-4000:]


async def test_an_owner_that_is_gone_is_a_503_naming_it_and_the_other_host_keeps_serving(cluster, placed):
    """Last in the module: it kills host-a."""
    a, b = cluster
    lost, kept = placed["host-a"]["id"], placed["host-b"]["id"]
    relayed = await websocket_connect(  # a websocket through host-b to host-a's kernel
        HTTPRequest(
            b.url.replace("http://", "ws://") + f"/api/kernels/{placed['host-a']['kernel']['id']}/channels",
            headers={"Authorization": f"token {ALICE}"},
        )
    )
    chunks: list[bytes] = []
    first = asyncio.Event()

    def got(chunk: bytes) -> None:
        chunks.append(chunk)
        first.set()

    long_cell = {"code": "import time\nfor i in range(600):\n    print(i, flush=True); time.sleep(0.1)"}
    # A streamed execute through host-b, running on host-a.
    streaming = asyncio.create_task(
        b.call("POST", f"/api/sessions/{lost}/execute?stream=1", long_cell, streaming_callback=got)
    )
    await asyncio.wait_for(first.wait(), 60)
    a.serve.kill9()
    try:
        # The stream ends with an error line naming the host; the websocket closes 1011, saying why.
        status, _, _ = await asyncio.wait_for(streaming, 60)
        events = [json.loads(line) for line in b"".join(chunks).splitlines() if line.strip()]
        assert status == 200 and events[0]["type"] == "output", events[:3]
        assert events[-1]["type"] == "error" and events[-1]["error"] == "cluster_unavailable", events[-1]
        assert "host-a" in events[-1]["message"]
        while await asyncio.wait_for(relayed.read_message(), 30) is not None:
            pass
        assert relayed.close_code == 1011 and "host-a" in (relayed.close_reason or ""), relayed.close_reason
        status, answer, headers = await b.call("POST", f"/api/sessions/{lost}/execute", {"code": "x"})
        assert status == 503 and answer["error"] == "cluster_unavailable", (status, answer)
        assert "host-a" in answer["message"] and "retry" in answer["message"].lower(), answer
        assert headers.get("Retry-After"), headers
        status, result, _ = await b.call("POST", f"/api/sessions/{kept}/execute", {"code": "print(6 * 7)"})
        assert status == 200 and result["outputs"][0]["text"] == "42\n", (status, result)
    finally:  # host-a's sandboxes: a gateway on its state dir with --on-exit delete removes them
        a.serve.port = free_port()
        await a.serve.start(*a.flags)
        assert await a.serve.term() == 0, a.serve.output[-4000:]
        assert not container_ids_of(lost)
