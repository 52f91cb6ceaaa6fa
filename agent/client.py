"""Async Python client for the session API: ``AsyncSandkernel`` and ``AsyncSession``.

    async with AsyncSandkernel() as sk:              # SANDKERNEL_URL / SANDKERNEL_TOKEN
        async with sk.session(profile="small") as s:  # deleted on exit
            result = await s.run("import pandas as pd; pd.__version__")
            print(result.text, result.status, result.duration)

Why tornado's HTTP client: tornado is already a core dependency (the gateway), and its
``streaming_callback`` reads the NDJSON execute stream as it arrives. Every call opens its own
connection (no keep-alive pool, no websocket), so nothing has to reconnect after a restart.

Riding through a gateway restart (the gateway keeps its sessions across one): idempotent calls
(GET, PUT, DELETE, interrupt) are retried with exponential backoff on a refused or dropped
connection and on 502/503/504 for up to ``restart_wait`` seconds, long enough for a gateway to
come back and re-adopt its sessions. Calls that start work (create, execute, restart, markdown)
are retried only when the request was not run: the connection was refused (it never left this
process) or a stopping gateway answered 503 ``gateway_restarting``. Otherwise they are never
sent again, since a retry could run the code twice: an execute that loses its gateway raises
:class:`~sandkernel.agent.execution.GatewayRestarted` after waiting for the gateway to answer
again, so the next call works. The sync twins live in :mod:`sandkernel.agent.sync_client`.

In a cluster, a session's calls go straight to the host that holds it once an answer has named
that host (sandkernel/owner_hint.py): the endpoint's forwarding hop (about 2 ms here) is skipped.
On by default, because it costs nothing where the hosts cannot be reached: a host is followed only
over the endpoint's own scheme (an https endpoint never sends the token to an http host), its
connection may take :data:`DIRECT_CONNECT_SECONDS`, and a host that cannot be reached is skipped
for :data:`UNREACHABLE_SECONDS` while the calls go through the endpoint (the one that failed is
sent again only when it never left, as above). ``direct_to_owner=False`` always uses the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest, HTTPResponse
from tornado.simple_httpclient import HTTPTimeoutError

from sandkernel.agent.errors import (
    ClientError,
    GatewayError,
    GatewayUnreachableError,
    RequestTimeoutError,
    error_for_status,
)
from sandkernel.agent.execution import Execution, GatewayRestarted, restart_message
from sandkernel.output_text import readable_text
from sandkernel.owner_hint import HOST_HEADER
from sandkernel.shell import ShellResult

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8888"
_SESSION_PATH = re.compile(r"/api/sessions/([^/?]+)")  # a session's own calls: the id they name
ENDPOINT_CONNECT_SECONDS = 10.0
# A session's host, named by an answer, may be unreachable from here (a cluster behind a load
# balancer): its connection gets less time, and once it failed the host is left alone a while.
DIRECT_CONNECT_SECONDS = 3.0
UNREACHABLE_SECONDS = 60.0
RETRYABLE_STATUSES = (502, 503, 504)
# Gateway error codes that say the request was not run (safe to send again, even an execute).
# sandbox_engine_unavailable: the gateway's start breaker refused a new session at once (Docker
# is down or too slow); retried after the Retry-After it sends.
NOT_RUN_CODES = ("gateway_restarting", "sandbox_engine_unavailable")
MAX_RETRY_AFTER = 60.0  # seconds: a gateway's Retry-After is a hint, never a reason to hang
# Seconds a resume, fork or rewind may take: where a runtime cannot restore memory, the gateway
# rebuilds it by re-running the session's recorded cells, so the call lasts as long as they did.
SNAPSHOT_TIMEOUT = 1800.0
OutputCallback = Callable[[dict[str, Any]], Any]
FailureOf = Callable[[HTTPResponse], "ClientError | None"]


def retry_after(response: HTTPResponse | None) -> float:
    """Seconds a response's ``Retry-After`` header asks for (0 when none or unreadable; at most
    :data:`MAX_RETRY_AFTER`; an HTTP date is not used by the gateway and is ignored)."""
    value = response.headers.get("Retry-After") if response is not None else None
    try:
        seconds = float(value) if value else 0.0
    except ValueError:
        return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER) if math.isfinite(seconds) else 0.0


class AsyncSandkernel:
    """A connection to one gateway with one token.

    ``url`` and ``token`` default to ``SANDKERNEL_URL`` and ``SANDKERNEL_TOKEN``.
    ``request_timeout`` bounds calls other than ``run`` (whose bound follows its own timeout).
    ``restart_wait`` is how long a retried call keeps trying (and how long an execute that lost
    its gateway waits for it to answer again); retries back off from ``backoff`` seconds,
    doubling up to ``max_backoff``; ``max_retries`` (None: no count, only the time bound) caps them.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        request_timeout: float = 120.0,
        restart_wait: float = 60.0,
        max_retries: int | None = None,
        backoff: float = 0.25,
        max_backoff: float = 2.0,
        direct_to_owner: bool = True,
    ) -> None:
        self.url = (url or os.environ.get("SANDKERNEL_URL") or DEFAULT_URL).rstrip("/")
        self._scheme = urlsplit(self.url).scheme  # a session's host is followed over this one only
        self.token = token or os.environ.get("SANDKERNEL_TOKEN")
        self.request_timeout = request_timeout
        self.restart_wait = restart_wait
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.direct_to_owner = direct_to_owner
        self._owners: dict[str, str] = {}  # session id -> the URL of the host holding it (direct_to_owner)
        self._unreachable: dict[str, float] = {}  # host URL -> monotonic time until which it is not followed
        self._http: AsyncHTTPClient | None = None

    async def __aenter__(self) -> AsyncSandkernel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- sessions -------------------------------------------------------------------------

    async def create_session(
        self,
        profile: str | None = None,
        limits: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> AsyncSession:
        """Start a sandbox (a container with its kernel); its transcript starts with it."""
        body: dict[str, Any] = {"limits": limits or {}, "metadata": metadata or {}}
        if profile:
            body["profile"] = profile
        info = await self.request("POST", "/api/sessions", body, idempotent=False, timeout=300)
        return AsyncSession(self, info)

    @contextlib.asynccontextmanager
    async def session(self, profile: str | None = None, **options: Any) -> AsyncIterator[AsyncSession]:
        """``async with sk.session() as s:``: a session deleted on exit (its notebook is kept)."""
        created = await self.create_session(profile, **options)
        try:
            yield created
        finally:
            with contextlib.suppress(ClientError):
                await created.delete()

    async def get_session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self.request("GET", f"/api/sessions/{quote(session_id)}"))

    async def list_sessions(self) -> list[dict[str, Any]]:
        return await self.request("GET", "/api/sessions")

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/api/health")

    async def wait_until_up(self, timeout: float | None = None) -> bool:
        """Whether the gateway answers its health check with ``ok`` within ``timeout`` (default
        ``restart_wait``), polling with the same backoff as a retried call; a gateway that says it
        is ``stopping`` is the old process, not yet the one that comes back."""

        def not_up(response: HTTPResponse) -> ClientError | None:
            failure = _failure(response, "GET", "/api/health")
            if failure is None and (_parse(response) or {}).get("status") == "stopping":  # the old process
                return GatewayError("the gateway is stopping", 503, "gateway_restarting")
            return failure

        try:
            await self._fetch(
                lambda: self._request("GET", "/api/health", None, 10),
                "GET",
                "/api/health",
                True,
                not_up,
                self.restart_wait if timeout is None else timeout,
            )
            return True
        except ClientError:
            return False

    # -- HTTP -----------------------------------------------------------------------------

    def _client(self) -> AsyncHTTPClient:
        if self._http is None:
            self._http = AsyncHTTPClient(force_instance=True, max_clients=64)
        return self._http

    def _request(self, method: str, path: str, body: bytes | None, timeout: float | None, **kw: Any) -> HTTPRequest:
        headers = {"Accept": "application/json", **kw.pop("headers", {})}
        if self.token:
            headers["Authorization"] = f"token {self.token}"
        if body is None and method in ("POST", "PUT"):
            body = b""
        base = self._base_for(path)
        return HTTPRequest(
            base + path,
            method=method,
            body=body,
            headers=headers,
            request_timeout=timeout or self.request_timeout,
            connect_timeout=ENDPOINT_CONNECT_SECONDS if base == self.url else DIRECT_CONNECT_SECONDS,
            **kw,
        )

    async def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        *,
        raw: bytes | None = None,
        idempotent: bool | None = None,
        timeout: float | None = None,
        parse: bool = True,
    ) -> Any:
        """One call; JSON in and out. Raises the :mod:`~sandkernel.agent.errors` class for the failure."""
        if idempotent is None:
            idempotent = method in ("GET", "PUT", "DELETE", "HEAD")
        body = raw if raw is not None else (json.dumps(json_body).encode() if json_body is not None else None)
        headers = {"Content-Type": "application/json"} if raw is None and body is not None else {}
        response = await self._fetch(
            lambda: self._request(method, path, body, timeout, headers=headers),
            method,
            path,
            idempotent,
            lambda response: _failure(response, method, path),
        )
        return _parse(response) if parse else response.body

    async def _fetch(
        self,
        make: Callable[[], HTTPRequest],
        method: str,
        path: str,
        idempotent: bool,
        failure_of: FailureOf,
        wait: float | None = None,
    ) -> HTTPResponse:
        """Send a request (``make`` builds a fresh one per attempt), retrying what is safe to
        retry (see the module docstring) until ``wait`` (default ``restart_wait``) has passed."""
        deadline = time.monotonic() + (self.restart_wait if wait is None else wait)
        attempt = 0
        while True:
            response: HTTPResponse | None = None
            try:
                response = await self._client().fetch(make(), raise_error=False)
                failure = failure_of(response)
            except (OSError, HTTPClientError) as err:  # refused, dropped, timed out: no HTTP answer
                failure = self._transport_failure(method, path, err, idempotent)
                self._forget_owner(path)  # the next attempt goes to the endpoint
            if failure is None:
                self._learn_owner(method, path, response)
                return response
            never_sent = (isinstance(failure, GatewayUnreachableError) and not failure.sent) or (
                failure.code in NOT_RUN_CODES
            )
            retryable = never_sent or (
                idempotent and (isinstance(failure, GatewayUnreachableError) or failure.status in RETRYABLE_STATUSES)
            )
            # jitter: the clients of one restarted gateway do not all come back in the same instant
            delay = min(self.max_backoff, self.backoff * 2**attempt) * random.uniform(0.8, 1.0)
            delay = max(delay, retry_after(response))  # the gateway said when to come back
            out_of_tries = self.max_retries is not None and attempt >= self.max_retries
            if not retryable or out_of_tries or time.monotonic() + delay > deadline:
                raise failure
            if attempt == 0:  # say it once: a caller may wait up to restart_wait from here
                log.warning("%s; retrying %s %s for up to %.0f s", failure, method, path, deadline - time.monotonic())
            else:
                log.info("retrying %s %s in %.2fs: %s", method, path, delay, failure)
            await asyncio.sleep(delay)
            attempt += 1

    async def gateway_restarted(self, how: str, execution: Execution | None = None) -> GatewayRestarted:
        """The outcome of an execute that lost its gateway (``how``: connection_lost |
        gateway_restart), after waiting up to ``restart_wait`` for the gateway to answer again."""
        began = time.monotonic()
        came_back = await self.wait_until_up()
        log.warning("an execute lost its gateway (%s); gateway back: %s", how, came_back)
        return GatewayRestarted(restart_message(how, came_back, time.monotonic() - began), execution, came_back)

    async def stream_execute(
        self, session_id: str, body: dict[str, Any], on_output: OutputCallback, timeout: float
    ) -> dict[str, Any]:
        """POST execute with NDJSON streaming: ``on_output`` gets each output as it happens."""
        buffer = bytearray()
        result: dict[str, Any] = {}
        streamed: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []

        def on_chunk(chunk: bytes) -> None:
            buffer.extend(chunk)
            while b"\n" in buffer:
                line, _, rest = bytes(buffer).partition(b"\n")
                buffer[:] = rest
                try:
                    event = json.loads(line)
                except ValueError:  # an error body is one JSON document; handled below
                    buffer[:0] = line + b"\n"
                    return
                if event.get("type") == "output":
                    streamed.append(event["output"])
                    on_output(event["output"])
                elif event.get("type") == "result":
                    result.update(event["result"])
                elif event.get("type") == "error":  # the execution failed after the stream began
                    failed.append(event)

        path = f"/api/sessions/{quote(session_id)}/execute?stream=1"
        began = time.monotonic()

        def make() -> HTTPRequest:
            return self._request(
                "POST",
                path,
                json.dumps(body).encode(),
                timeout,
                headers={"Content-Type": "application/json", "Accept": "application/x-ndjson"},
                streaming_callback=on_chunk,
            )

        def lost() -> Execution:  # what the caller saw before the cut
            return Execution(
                status="detached",
                outputs=list(streamed),
                execution_count=None,
                duration=time.monotonic() - began,
                text=readable_text(streamed),
                ended_by="connection_lost",
            )

        def not_run(response: HTTPResponse) -> ClientError | None:
            """A failure that says the code was not run (sent again); other statuses are judged below."""
            failure = _failure(response, "POST", path, body=bytes(buffer)) if response.code != 200 else None
            if failure is None or failure.code not in NOT_RUN_CODES:
                return None
            buffer.clear()  # the next attempt's body starts afresh
            return failure

        try:
            response: HTTPResponse | None = await self._fetch(make, "POST", path, False, not_run)
        except GatewayUnreachableError as err:
            if not err.sent:
                raise
            if not result and not failed:  # no outcome arrived whole: how far the code got is unknown
                raise await self.gateway_restarted("connection_lost", lost()) from err
            response = None  # the outcome arrived, then the connection dropped: the outcome stands
        if response is not None and response.code == 200 and not result and not failed:
            raise await self.gateway_restarted("connection_lost", lost())  # the stream ended without its result
        if failed:
            event = failed[0]
            raise error_for_status(event.get("status", 500), event.get("message", ""), event.get("error", ""))
        if not result and response is not None:
            failure = _failure(response, "POST", path, body=bytes(buffer))
            raise failure or ClientError("the execute stream ended without a result", response.code)
        # The final line carries only what the stream did not: the result is both, in order.
        result["outputs"] = streamed + list(result.get("outputs") or [])
        result.setdefault("text", readable_text(result["outputs"]))
        return result

    def _base_for(self, path: str) -> str:
        """Where a call goes: the session's host when an answer named it (direct_to_owner), else
        the endpoint."""
        found = _SESSION_PATH.match(path) if self._owners else None
        return self._owners.get(found.group(1), self.url) if found else self.url

    def _learn_owner(self, method: str, path: str, response: HTTPResponse) -> None:
        """Remember the host an answer about a session named (a create: the new session's), if
        it is reached over the endpoint's scheme and has not just failed."""
        if not self.direct_to_owner:
            return
        host = (response.headers.get(HOST_HEADER) or "").rstrip("/")
        named = urlsplit(host)
        if named.scheme != self._scheme or not named.netloc:
            return  # never a downgrade: the token goes over what the endpoint's URL said
        if self._unreachable.get(host, 0.0) > time.monotonic():
            return
        found = _SESSION_PATH.match(path)
        session_id = found.group(1) if found else None
        if session_id is None and method == "POST" and path == "/api/sessions":
            session_id = quote(str((_parse(response) or {}).get("id", ""))) or None
        if session_id is None:
            return
        if method == "DELETE" and found is not None and path.partition("?")[0] == found.group(0):
            self._owners.pop(session_id, None)
        else:
            self._owners[session_id] = host

    def _forget_owner(self, path: str) -> None:
        """A call got no answer: if it went to a session's host, that host is not followed for
        :data:`UNREACHABLE_SECONDS` (every session it holds goes through the endpoint meanwhile)."""
        found = _SESSION_PATH.match(path)
        host = self._owners.get(found.group(1)) if found else None
        if host is None:
            return
        self._unreachable[host] = time.monotonic() + UNREACHABLE_SECONDS
        self._owners = {sid: url for sid, url in self._owners.items() if url != host}

    def _transport_failure(self, method: str, path: str, err: Exception, idempotent: bool = True) -> ClientError:
        if isinstance(err, HTTPTimeoutError):
            return RequestTimeoutError(f"{method} {path}: no answer from {self.url} within the request timeout")
        if isinstance(err, ConnectionRefusedError):  # nothing listening: the request never left
            return GatewayUnreachableError(f"cannot reach the sandkernel gateway at {self.url}: {err}", sent=False)
        unknown = "" if idempotent else f"; {method} {path} was sent, whether it took effect is unknown"
        return GatewayUnreachableError(f"lost the connection to the sandkernel gateway at {self.url}: {err}{unknown}")


def file_url_path(path: str) -> str:
    """``path`` as the tail of a files URL: an absolute path's leading ``/`` is sent as ``%2F``
    (a ``//`` in a URL is merged into one by some proxies, which would make it relative)."""
    quoted = quote(path)
    return "%2F" + quoted[1:] if quoted.startswith("/") else quoted


class AsyncSession:
    """One sandbox: a kernel whose state persists between :meth:`run` calls, and its transcript."""

    def __init__(self, client: AsyncSandkernel, info: dict[str, Any], restore: dict[str, Any] | None = None) -> None:
        self.client = client
        self.info = info
        # How a forked session got its state (restored_by, per-cell verdicts, seconds): the
        # gateway's reply for this fork, kept so a caller can judge each fork on its own.
        self.restore = restore

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def kernel_id(self) -> str:
        return self.info["kernel"]["id"]

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id} at {self.client.url}>"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(ClientError):
            await self.delete()

    def _path(self, suffix: str = "") -> str:
        return f"/api/sessions/{quote(self.id)}{suffix}"

    async def run(
        self,
        code: str,
        timeout: float | None = None,
        *,
        tag: str | None = None,
        on_output: OutputCallback | None = None,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
        on_result: Callable[[dict[str, Any]], Any] | None = None,
        on_error: Callable[[dict[str, Any]], Any] | None = None,
        check: bool = False,
        source: str | None = None,
    ) -> Execution:
        """Run ``code`` in the session's kernel; state persists between calls.

        With a callback, outputs stream in as they happen (``on_output`` gets every output in
        nbformat shape; ``on_stdout``/``on_stderr`` get text; ``on_result`` MIME bundles;
        ``on_error`` the error output). ``tag`` is recorded in the transcript cell (e.g. a
        tool-use id), and ``source`` too: the integration running the code (one of
        :data:`sandkernel.doors.CLIENT_DOORS`; default ``session_api``). An exception in the
        code is ``result.error``, not raised, unless ``check=True``; timeouts, kernel deaths and
        OOM kills are statuses likewise.

        Raises :class:`~sandkernel.agent.execution.GatewayRestarted` when the gateway went away
        before the result (the connection dropped, or the gateway let go of the execution as it
        stopped: status ``detached``), after waiting for it to answer again: the code may or may
        not have run to completion, and it is never sent twice.
        """
        body: dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout"] = timeout
        if tag is not None:
            body["tag"] = tag
        if source is not None:
            body["source"] = source
        request_timeout = (timeout + 120) if timeout else 3600.0
        callbacks = (on_output, on_stdout, on_stderr, on_result, on_error)
        if any(callbacks):
            dispatch = _dispatcher(*callbacks)
            reply = await self.client.stream_execute(self.id, body, dispatch, request_timeout)
        else:
            reply = await self._post_cell("/execute", body, request_timeout)
        execution = Execution.from_reply(reply)
        if execution.status == "detached":  # cut by a stopping gateway; the code may still be running
            raise await self.client.gateway_restarted(execution.ended_by or "gateway_restart", execution)
        return execution.raise_for_status() if check else execution

    async def shell(
        self,
        command: str,
        timeout: float | None = None,
        *,
        source: str | None = None,
        output_limit: int | None = None,
    ) -> ShellResult:
        """Run a ``/bin/sh`` command in /workspace, as a cell of the session's kernel (recorded in
        the transcript). ``timeout`` (default the session's execute_timeout) kills the command's
        whole process group and reports exit code 124; a non-zero exit is a result, not an error.
        ``output_limit``: bytes of output brought back (head and tail, the middle cut; default
        64 KiB, at most 4 MiB). A gateway restart raises
        :class:`~sandkernel.agent.execution.GatewayRestarted` as in :meth:`run`."""
        body: dict[str, Any] = {"command": command}
        if timeout is not None:
            body["timeout"] = timeout
        if output_limit is not None:
            body["output_limit"] = output_limit
        if source is not None:
            body["source"] = source
        reply = await self._post_cell("/shell", body, (timeout + 120) if timeout else 3600.0)
        if reply.get("status") == "detached":
            raise await self.client.gateway_restarted(reply.get("ended_by") or "gateway_restart")
        fields = {field.name for field in dataclasses.fields(ShellResult)}
        return ShellResult(**{key: value for key, value in reply.items() if key in fields})

    async def _post_cell(self, suffix: str, body: dict[str, Any], request_timeout: float) -> dict[str, Any]:
        """POST something that runs as a cell: never resent; a connection lost after sending is a
        gateway restart (the cell may have run), one refused before sending is raised as it is."""
        try:
            return await self.client.request(
                "POST", self._path(suffix), body, idempotent=False, timeout=request_timeout
            )
        except GatewayUnreachableError as err:
            if not err.sent:  # refused until restart_wait passed: the code never reached a gateway
                raise
            raise await self.client.gateway_restarted("connection_lost") from err

    async def interrupt(self) -> None:
        await self.client.request("POST", self._path("/interrupt"), idempotent=True)

    async def restart(self) -> dict[str, Any]:
        """Restart the kernel: variables are gone, workspace files stay."""
        self.info = await self.client.request("POST", self._path("/restart"), idempotent=False, timeout=300)
        return self.info

    async def refresh(self) -> dict[str, Any]:
        self.info = await self.client.request("GET", self._path())
        return self.info

    @property
    def state(self) -> str | None:
        """``running``, ``paused`` or ``lost`` as of the last reply (:meth:`refresh` asks again)."""
        return self.info.get("state")

    # -- snapshots ------------------------------------------------------------------------
    # The gateway can put a session to disk and bring it back. Where a runtime cannot save a
    # kernel's memory, the gateway restores the files exactly and rebuilds memory by re-running
    # the recorded cells ("restored_by": "replay"), with a verdict per cell: a cell whose output
    # differs, or that reads something outside the sandbox, may not come back the same, so the
    # replies are returned whole for the caller to check rather than summarised.

    async def pause(self, timeout: float | None = None) -> dict[str, Any]:
        """Write the session to disk and free its container, memory and CPU. The reply has
        ``state`` ("paused"), ``snapshot`` (id, bytes, cells, created) and ``seconds``.

        Why pause rather than delete: a kernel an agent spent minutes loading data into is kept,
        at the cost of disk only, and comes back on :meth:`resume` or on the next :meth:`run`,
        :meth:`shell` or file call. Raises :class:`~sandkernel.agent.errors.SessionBusyError`
        while code runs, :class:`~sandkernel.agent.errors.SnapshotQuotaError` when the tenant's
        snapshot disk is full, :class:`~sandkernel.agent.errors.SnapshotFailedError` otherwise
        (the session then keeps running). Not resent after a lost connection: ask :meth:`refresh`."""
        reply = await self.client.request("POST", self._path("/pause"), idempotent=False, timeout=timeout or 600)
        await self._merge_state(reply)
        return reply

    async def resume(self, timeout: float | None = None) -> dict[str, Any]:
        """Bring a paused session back; on a running one, nothing happens (``restored_by`` is None).

        The reply says how: ``restored_by`` ("replay" re-ran the recorded cells), ``cells`` (a
        verdict and note per cell), ``files`` and ``seconds``. Calling it is optional, since the
        next execute or file call resumes by itself, but doing it first puts the wait where the
        caller chooses and shows the verdicts. Resent like a GET after a gateway restart, since a
        second resume of a resumed session does nothing.
        :class:`~sandkernel.agent.errors.SnapshotRejectedError`: the snapshot failed its check."""
        reply = await self.client.request(
            "POST", self._path("/resume"), idempotent=True, timeout=timeout or SNAPSHOT_TIMEOUT
        )
        await self._merge_state(reply)
        return reply

    async def fork(self, count: int = 1, cell: int | None = None, timeout: float | None = None) -> list[AsyncSession]:
        """``count`` new sessions (1..10) with this session's state, each its own sandbox and
        transcript, bound to the same client; ``cell``: the state right after that code cell
        instead of now (its files as that cell left them where the gateway keeps per-cell checkpoints,
        else remade by re-running the cells: the fork's ``restore["files"]`` says which).

        Why: trying several approaches from one point (a tree search, a destructive step tried on
        a copy) without redoing the work that led there. Each fork's part of the reply (how it
        was restored, the verdicts) is its ``restore``. Counted against the tenant's session
        limit (:class:`~sandkernel.agent.errors.LimitExceededError`). Never resent after a lost
        connection: it may have made sessions; :meth:`AsyncSandkernel.list_sessions` shows them."""
        body: dict[str, Any] = {"count": count}
        if cell is not None:
            body["cell"] = cell
        reply = await self.client.request(
            "POST", self._path("/fork"), body, idempotent=False, timeout=timeout or SNAPSHOT_TIMEOUT
        )
        return [AsyncSession(self.client, fork["session"], restore=fork) for fork in reply["forks"]]

    async def rewind(self, cell: int, timeout: float | None = None) -> dict[str, Any]:
        """Return the session to its state right after code cell ``cell``: later variables and
        the files later cells wrote are gone. The transcript records the rewind.

        The reply is :meth:`resume`'s plus ``rewound_to`` and ``files`` ("checkpoint": the files
        as they were after that cell; "replay": rebuilt by re-running cells). Why it exists: an
        agent that went down a wrong path can step back without starting over."""
        reply = await self.client.request(
            "POST", self._path("/rewind"), {"cell": cell}, idempotent=False, timeout=timeout or SNAPSHOT_TIMEOUT
        )
        await self._merge_state(reply)
        return reply

    async def _merge_state(self, reply: dict[str, Any]) -> None:
        """Keep ``info`` current after a snapshot call: the session model when the reply carries
        one; else, after a restore (a new sandbox, so a new kernel id for websocket users), the
        model asked for again; else the reply's state and snapshot over the last model."""
        if isinstance(reply.get("session"), dict):
            self.info = reply["session"]
        elif reply.get("restored_by"):
            await self.refresh()
        else:
            self.info = {**self.info, "state": reply.get("state", self.state)}
            if "snapshot" in reply:
                self.info["snapshot"] = reply["snapshot"]

    async def delete(self, delete_notebook: bool = False) -> None:
        query = "?delete_notebook=1" if delete_notebook else ""
        await self.client.request("DELETE", self._path(query))

    async def upload(self, path: str, data: bytes | str) -> dict[str, Any]:
        """Write a file in the session's sandbox: ``path`` relative to /workspace, or absolute
        (anywhere the sandbox's user may write, e.g. /tmp); missing directories are made."""
        raw = data.encode() if isinstance(data, str) else data
        return await self.client.request("PUT", self._path(f"/files/{file_url_path(path)}"), raw=raw)

    async def upload_file(self, local: str | Path, path: str | None = None) -> dict[str, Any]:
        local = Path(local)
        data = await asyncio.to_thread(local.read_bytes)
        return await self.upload(path or local.name, data)

    async def download(self, path: str) -> bytes:
        return await self.client.request("GET", self._path(f"/files/{file_url_path(path)}"), parse=False)

    async def list_files(self, path: str = "") -> list[dict[str, Any]]:
        return await self.client.request("GET", self._path("/files") + "?" + urlencode({"path": path}))

    async def variables(self) -> list[dict[str, Any]]:
        """Names, types and sizes in the kernel's namespace (cheap; values are not sent)."""
        return await self.client.request("GET", self._path("/variables"))

    async def notebook(self) -> dict[str, Any]:
        """The session's transcript as an nbformat v4 document."""
        return await self.client.request("GET", self._path("/notebook"))

    async def add_markdown(self, text: str) -> None:
        """Add a markdown cell (e.g. the agent's reasoning) to the transcript."""
        await self.client.request("POST", self._path("/markdown"), {"text": text}, idempotent=False)


def _dispatcher(
    on_output: OutputCallback | None,
    on_stdout: Callable[[str], Any] | None,
    on_stderr: Callable[[str], Any] | None,
    on_result: Callable[[dict[str, Any]], Any] | None,
    on_error: Callable[[dict[str, Any]], Any] | None,
) -> OutputCallback:
    def dispatch(output: dict[str, Any]) -> None:
        if on_output:
            on_output(output)
        kind = output.get("output_type")
        if kind == "stream":
            handler = on_stdout if output.get("name") == "stdout" else on_stderr
            if handler:
                handler(output.get("text", ""))
        elif kind in ("display_data", "execute_result") and on_result:
            on_result(output.get("data", {}))
        elif kind == "error" and on_error:
            on_error(output)

    return dispatch


def _failure(response: HTTPResponse, method: str, path: str, body: bytes | None = None) -> ClientError | None:
    """The exception for a failed response, or None when it succeeded."""
    if response.code < 400 and response.error is None:
        return None
    if response.code == 599:  # tornado's code for "no HTTP response"
        if isinstance(response.error, HTTPTimeoutError):
            return RequestTimeoutError(f"{method} {path}: no answer within the request timeout")
        return GatewayUnreachableError(f"{method} {path}: {response.error}")
    raw = body if body is not None else (response.body or b"")
    try:
        payload = json.loads(raw)
        message, code = payload.get("message") or str(payload), payload.get("error", "")
    except (ValueError, AttributeError):
        message, code = raw.decode(errors="replace")[:500] or response.reason, ""
    return error_for_status(response.code, message, code)


def _parse(response: HTTPResponse) -> Any:
    if not response.body:
        return None
    return json.loads(response.body)
