"""The host side of controlled egress: one HTTP proxy per session, on a unix socket.

The sandbox still has no network. Its only way out is this socket, bind-mounted read-only into
the container (``/run/sandkernel-egress/egress.sock``); a small relay in the sandbox exposes it
as ``http://127.0.0.1:3128`` for HTTP_PROXY/HTTPS_PROXY. Everything the kernel sends here is
hostile: the request head is size- and time-limited, the host is validated as a name, the
policy is checked on that name before any DNS lookup, then on the resolved addresses, and only
then is a connection made. HTTP (absolute-form) and HTTPS (CONNECT) are served; each request is
one connection. Every allowed and refused request becomes an :class:`EgressRecord`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sandkernel.kernels.egress.policy import EgressPolicy, RateLimiter

log = logging.getLogger(__name__)

CONTAINER_EGRESS_DIR = "/run/sandkernel-egress"
SOCKET_NAME = "egress.sock"
RELAY_PORT = 3128
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0
MAX_RECORDS = 10_000
_HOST = re.compile(r"^[A-Za-z0-9.-]{1,253}$")
_DROPPED_HEADERS = {"proxy-connection", "proxy-authorization", "connection", "keep-alive", "host"}


@dataclasses.dataclass
class EgressRecord:
    """One request through the proxy, allowed or not."""

    at: str
    method: str
    host: str
    port: int
    verdict: str  # allowed | denied | failed
    reason: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Refused(Exception):
    def __init__(self, status: int, reason: str, verdict: str = "denied") -> None:
        super().__init__(reason)
        self.status, self.reason, self.verdict = status, reason, verdict


class EgressProxy:
    def __init__(self, policy: EgressPolicy, session_id: str, directory: Path) -> None:
        self.policy = policy
        self.session_id = session_id
        self.directory = directory
        self.records: collections.deque[EgressRecord] = collections.deque(maxlen=MAX_RECORDS)
        self.on_record: Callable[[EgressRecord], None] | None = None
        self._limiter = RateLimiter(policy)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def socket_path(self) -> Path:
        return self.directory / SOCKET_NAME

    async def start(self) -> None:
        await asyncio.to_thread(self.directory.mkdir, mode=0o755, parents=True, exist_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path), limit=MAX_HEAD_BYTES)
        os.chmod(self.socket_path, 0o666)  # the sandbox's uid connects; the directory stays root's
        log.info("egress proxy up", extra={"session": self.session_id, "allow": list(self.policy.allow)})

    async def close(self, keep_directory: bool = False) -> None:
        """Stop serving and remove the socket; ``keep_directory`` when the sandbox lives on (a
        gateway restart): its container's bind mount names this very directory, so the next
        process's proxy must bind its socket in it, not in a new one made at the same path."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        if not keep_directory:
            with contextlib.suppress(OSError):
                self.directory.rmdir()

    def summary(self) -> dict[str, Any]:
        """Counts per host and verdict, for the notebook's metadata."""
        hosts: dict[str, dict[str, int]] = {}
        for record in self.records:
            entry = hosts.setdefault(f"{record.host}:{record.port}", {"allowed": 0, "denied": 0, "failed": 0})
            entry[record.verdict] += 1
        return {
            "policy": self.policy.to_dict(),
            "requests": len(self.records),
            "denied": sum(1 for r in self.records if r.verdict == "denied"),
            "hosts": hosts,
        }

    # -- one client connection -------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        started = time.monotonic()
        record = EgressRecord(
            dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"), "?", "?", 0, "denied"
        )
        try:
            await self._handle(reader, writer, record)
        except Refused as refusal:
            record.verdict, record.reason = refusal.verdict, refusal.reason
            await self._refuse(writer, refusal)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError) as err:
            record.verdict = "failed" if record.verdict == "allowed" else record.verdict
            record.reason = record.reason or f"connection ended: {type(err).__name__}"
        finally:
            record.seconds = round(time.monotonic() - started, 3)
            self._keep(record)
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    def _keep(self, record: EgressRecord) -> None:
        self.records.append(record)
        log.info(
            "egress %s %s:%s %s",
            record.verdict,
            record.host,
            record.port,
            record.reason,
            extra={"session": self.session_id, "egress": record.to_dict()},
        )
        if self.on_record is not None:
            with contextlib.suppress(Exception):  # a failing observer must not break the proxy
                self.on_record(record)

    async def _refuse(self, writer: asyncio.StreamWriter, refusal: Refused) -> None:
        phrase = f"sandkernel egress policy: {refusal.reason}".encode("ascii", "replace")[:300].decode()
        body = f"{phrase} (session {self.session_id})\n".encode()
        with contextlib.suppress(OSError):
            writer.write(
                f"HTTP/1.1 {refusal.status} {phrase}\r\nContent-Type: text/plain\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: EgressRecord) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except asyncio.LimitOverrunError:
            raise Refused(431, "request head too large") from None
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise Refused(400, "not an HTTP/1.x proxy request")
        method, target, _ = parts
        record.method = method
        if method == "CONNECT":
            host, _, port_text = target.rpartition(":")
            path = ""
        else:
            url = urlsplit(target)
            if url.scheme != "http" or not url.hostname:
                raise Refused(400, "only http:// URLs and CONNECT (for https) are proxied")
            host, port_text = url.hostname, str(url.port or 80)
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        if not _HOST.match(host or "") or not port_text.isdigit():
            raise Refused(400, "the target must be host:port with a DNS name")
        record.host, record.port = host.lower(), int(port_text)
        refusal = self.policy.name_refusal(record.host, record.port)
        if refusal:
            raise Refused(403, refusal)
        limited = self._limiter.refusal(record.host)
        if limited:
            raise Refused(429, limited)
        address = await self._resolve(record.host, record.port)
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(address, record.port), CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError) as err:
            raise Refused(
                502, f"cannot connect to {record.host}:{record.port} ({type(err).__name__})", "failed"
            ) from None
        record.verdict = "allowed"
        try:
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream_writer.write(self._origin_request(method, path, record.host, record.port, lines[1:]))
            await self._pipe(reader, writer, upstream_reader, upstream_writer, record)
        finally:
            upstream_writer.close()

    async def _resolve(self, host: str, port: int) -> str:
        """Resolve on the host, then refuse if any address is not allowed (no rebinding games)."""
        if host in self.policy.resolve:
            addresses = [self.policy.resolve[host]]
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError:
                raise Refused(502, f"{host} does not resolve", "failed") from None
            addresses = list(dict.fromkeys(info[4][0] for info in infos))
        for address in addresses:
            refusal = self.policy.address_refusal(address)
            if refusal:
                raise Refused(403, f"{host} resolves to {refusal}")
        return addresses[0]

    def _origin_request(self, method: str, path: str, host: str, port: int, header_lines: list[str]) -> bytes:
        headers = []
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep and name.strip().lower() not in _DROPPED_HEADERS:
                headers.append(f"{name.strip()}: {value.strip()}")
        for name, value in self.policy.headers_for(host).items():
            headers = [h for h in headers if h.split(":", 1)[0].lower() != name.lower()]
            headers.append(f"{name}: {value}")
        host_header = host if port == 80 else f"{host}:{port}"
        text = f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\n" + "".join(f"{h}\r\n" for h in headers)
        return (text + "Connection: close\r\n\r\n").encode("latin-1")

    async def _pipe(
        self,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        record: EgressRecord,
    ) -> None:
        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, field: str) -> None:
            while True:
                chunk = await asyncio.wait_for(src.read(65536), IDLE_TIMEOUT)
                if not chunk:
                    break
                setattr(record, field, getattr(record, field) + len(chunk))
                dst.write(chunk)
                await dst.drain()
            with contextlib.suppress(OSError):
                if dst.can_write_eof():
                    dst.write_eof()

        up = asyncio.create_task(copy(client_reader, upstream_writer, "bytes_up"))
        down = asyncio.create_task(copy(upstream_reader, client_writer, "bytes_down"))
        try:
            await down  # the response is over when the upstream closes (Connection: close / TLS end)
        finally:
            up.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.TimeoutError):
                await up
