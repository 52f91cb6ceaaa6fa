"""What every gateway handler shares: auth, JSON bodies, settings, and errors mapped in one place.

Errors are JSON ``{"error": code, "message": sentence}`` with the right status, whatever raised
them: :func:`error_reply` is the one mapping (the websocket handler uses it too). A
:class:`~sandkernel.errors.SandkernelError` carries its own status and code (see
sandkernel/errors.py), so handlers simply let session-layer errors propagate; an :class:`ApiError`
is a handler's own refusal of a request. Anything else is a bug: it is logged once with its
traceback and the client gets a 500 whose message says only that it was logged. An error that
carries ``retry_after`` (seconds) is answered with ``Retry-After`` (:func:`retry_after_of`), so a
client waits for an engine that restarts, an open start breaker or a gateway that restarts.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from tornado import web

from sandkernel.errors import SandkernelError, SessionClosedError
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.http_api import MAX_BODY_BYTES, MAX_DRAINED_BYTES, ApiError, phrase_code
from sandkernel.gateway.managed import ManagedSession, TooManySessionsError
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.service import SessionService
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.traffic import Traffic
from sandkernel.owner_hint import HOST_HEADER

if TYPE_CHECKING:
    from tornado.httputil import HTTPServerRequest


log = logging.getLogger(__name__)


# The cluster as a handler sees it, when this gateway is one of several: the single-host core
# names it by what it uses (gateway/cluster/ implements it on top of one host, and this module
# imports nothing of gateway/cluster: server.py hands the handlers its router).


class ForwardedRequest(Protocol):
    """A request another gateway forwarded, verified (gateway/cluster/signing.py's Forwarded)."""

    @property
    def origin(self) -> str: ...

    def check_body(self, body: bytes) -> None: ...


class OtherHost(Protocol):
    """Another gateway of the cluster (gateway/cluster/catalog.py's HostInfo)."""

    @property
    def host_id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def status(self) -> str: ...


class ClusterSeam(Protocol):
    """What a handler asks of the cluster (gateway/cluster/forward.py's ClusterLink)."""

    @property
    def url(self) -> str: ...

    def forwarded_from(self, request: HTTPServerRequest) -> ForwardedRequest | None: ...

    async def owner_elsewhere(
        self, tenant: str, *, session_id: str | None = None, kernel_id: str | None = None
    ) -> OtherHost | None: ...


class Route(Protocol):
    """How a request this host does not serve itself is answered (gateway/cluster/router.py's
    Forward: passed to the host that holds its session; AnswerLost: from a lost session's record)."""

    async def serve(self, handler: BaseHandler) -> None: ...


class Router(Protocol):
    """The cluster's router (gateway/cluster/router.py's ClusterRouter), consulted once per
    request: None from :meth:`route` means this host serves it."""

    async def route(self, handler: BaseHandler, session_id: str | None, kernel_id: str | None) -> Route | None: ...

    async def placed_elsewhere(self, handler: BaseHandler, profile: str | None, limits: Mapping[str, Any]) -> bool: ...

    async def forward(self, handler: BaseHandler, host: OtherHost) -> None: ...

    async def runtimes(self) -> set[str] | None: ...


HTTP_VERBS = ("get", "post", "put", "patch", "delete", "head", "options")


def _dispatched(verb: Callable[..., Any]) -> Callable[..., Awaitable[None]]:
    """A handler's verb, run through :meth:`BaseHandler._dispatch` (see there)."""

    @functools.wraps(verb)
    async def dispatched(self: BaseHandler, *args: Any, **kwargs: Any) -> None:
        await self._dispatch(verb, args, kwargs)

    dispatched.dispatches = True  # type: ignore[attr-defined]
    return dispatched


INTERNAL_ERROR = (500, "internal_error", "the gateway hit an unexpected error; it has been logged")
# What a request gets while the gateway is stopping (its sessions go on in the next process).
RESTARTING_MESSAGE = "the gateway is restarting; retry"
RETRY_AFTER_SECONDS = 2


def restarting_error() -> ApiError:
    """The 503 a request gets while the gateway stops: the next process will serve it."""
    return ApiError(503, RESTARTING_MESSAGE, "gateway_restarting", retry_after=RETRY_AFTER_SECONDS)


def retry_after_of(err: BaseException | None) -> int | None:
    """The ``Retry-After`` seconds for an error that says when to retry (whole seconds, at least
    1, as HTTP wants them), or None."""
    seconds = getattr(err, "retry_after", None)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds != seconds:
        return None
    return max(1, math.ceil(seconds))


def error_reply(err: BaseException) -> tuple[int, str, str]:
    """(status, code, message) for any exception a request raised: the one mapping.

    ApiError and SandkernelError say their own; tornado's HTTPError gets its status' phrase;
    anything else is a bug and gets :data:`INTERNAL_ERROR` (no detail leaves the gateway)."""
    if isinstance(err, ApiError):
        return err.status_code, err.code, err.message
    if isinstance(err, SandkernelError):
        return err.http_status, err.code, str(err) or type(err).__doc__ or err.code
    if isinstance(err, web.HTTPError):
        code = phrase_code(err.status_code)
        return err.status_code, code, err.log_message or err.reason or code.replace("_", " ")
    return INTERNAL_ERROR


def authenticate_request(handler: web.RequestHandler, auth: TokenAuth | None) -> str:
    """The tenant of the request's token; 401 when it has none or a wrong one (or a URL token
    where those are not allowed: the message says why and how to allow them); 429 once its
    address has failed too often (see auth.FailedAuthLimiter)."""
    if auth is None:
        return "default"
    query_token = handler.get_query_argument("token", None)
    header = handler.request.headers.get("Authorization")
    tenant = auth.tenant_for(header, query_token if auth.allow_query_token else None)
    if tenant is not None:
        return tenant
    if query_token and not auth.allow_query_token and not header:
        refuse_failed_authentication(
            handler,
            auth,
            "tokens in the URL are refused (URLs end up in logs): send 'Authorization: token <TOKEN>', "
            "or start the gateway with --allow-token-in-url",
        )
    refuse_failed_authentication(handler, auth, "missing or wrong token: send 'Authorization: token <TOKEN>'")


def authenticate_operator(handler: web.RequestHandler, auth: TokenAuth | None) -> str:
    """``operator`` for a request carrying the operator's metrics token; 403 when the operator
    set none (the numbers cover every tenant, so no tenant's token opens them), else 401/429 as
    :func:`authenticate_request`."""
    if auth is None:
        return "operator"
    if not auth.serves_metrics:
        raise ApiError(
            403,
            "/metrics is served to the operator only: start the gateway with --metrics-token TOKEN "
            "(or SANDKERNEL_METRICS_TOKEN) and scrape it with 'Authorization: Bearer TOKEN'",
            "forbidden",
        )
    if auth.is_metrics_token(handler.request.headers.get("Authorization")):
        return "operator"
    refuse_failed_authentication(
        handler, auth, "missing or wrong metrics token: send 'Authorization: Bearer <METRICS_TOKEN>' (not a tenant's)"
    )


def refuse_failed_authentication(handler: web.RequestHandler, auth: TokenAuth, message: str) -> NoReturn:
    """401 with ``message``, counted against the client's address; 429 once the address has
    failed too often (auth.FailedAuthLimiter), before any token is looked at."""
    address = handler.request.remote_ip or "unknown"
    wait = auth.failures.retry_after(address)
    if wait is not None:
        handler.set_header("Retry-After", str(int(wait) + 1))
        raise ApiError(
            429, f"too many failed authentications from {address}; retry in {int(wait) + 1}s", "too_many_failures"
        )
    auth.failures.record_failure(address)
    raise ApiError(401, message, "unauthorized")


def error_payload(code: str, message: str) -> bytes:
    """The JSON body of every error answer: ``{"error": code, "message": message}``."""
    return json.dumps({"error": code, "message": message}).encode()


@web.stream_request_body
class BaseHandler(web.RequestHandler):
    """Thin handlers: dependencies come through ``initialize``; subclasses implement verbs.

    Bodies are streamed in so an oversized one is refused with a JSON 413 before it is read;
    handlers use :attr:`body`. A handler with a tighter limit sets :attr:`max_body_bytes`.
    """

    max_body_bytes = MAX_BODY_BYTES

    registry: SessionRegistry
    auth: TokenAuth | None
    gateway_settings: GatewaySettings
    metrics: GatewayMetrics
    tenant: str
    served_while_stopping = False  # health, metrics and the API document answer to the end
    _counted = False
    forwarded: ForwardedRequest | None = None  # forwarded by another gateway (verified; body checked)
    route: Route | None = None  # the cluster router's answer for this request (None: served here)
    serves_session_model = False  # GET/DELETE /api/sessions/{id}: a lost session's model and delete
    forwarding: Any = None  # the exchange with that host, once started (gateway/cluster/forward.py)
    _refusal: ApiError | None = None  # answered; the rest of the body is dropped (refuse_then_drain)

    def initialize(
        self,
        registry: SessionRegistry,
        auth: TokenAuth | None,
        settings: GatewaySettings,
        service: SessionService,
        metrics: GatewayMetrics,
        router: Router | None = None,
        traffic: Traffic | None = None,
    ) -> None:
        """Called by tornado with the route's dependencies (server.py's route table); ``router``
        is the cluster's (None on a single host)."""
        self.registry = registry
        self.router = router
        self.traffic = traffic  # the server's count of requests in flight (None: not counted)
        self.service = service  # every execute, shell, interrupt and restart goes through it
        self.auth = auth
        self.gateway_settings = settings  # (``self.settings`` is tornado's application settings)
        self.metrics = metrics

    def prepare(self) -> Awaitable[None] | None:
        stream = self.request.connection.stream if self.request.connection else None
        if stream is not None:
            stream.set_nodelay(True)
        self._chunks: list[bytes] = []
        self._received = 0
        if self.registry is not None and not self.served_while_stopping:
            if self.registry.stopping:
                raise restarting_error()
            if self.traffic is not None:
                self.traffic.request_started()
                self._counted = True
        self.tenant = self.authenticate()
        declared = self.request.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            waits_for_us = self.request.headers.get("Expect", "").lower() == "100-continue"
            if waits_for_us or int(declared) > MAX_DRAINED_BYTES:
                raise self._too_large()  # no body in flight yet (or tornado cuts it off itself)
            self.refuse_then_drain(self._too_large())
            return None
        cluster = self.cluster
        if cluster is None:
            return None  # a single host: nothing below runs
        self.set_header(HOST_HEADER, cluster.url)  # this host answers (a forwarded answer: the owner's)
        forwarded = cluster.forwarded_from(self.request)  # 401 on a bad signature
        self.forwarded = forwarded
        session_id = self.path_kwargs.get("session_id")
        kernel_id = self.path_kwargs.get("kernel_id")
        if self.forwarded_from is not None or (session_id is None and kernel_id is None) or self.router is None:
            return None  # forwarded once already (the loop guard), or no session in the path
        return self._ask_router(self.router, session_id, kernel_id)

    @property
    def forwarded_from(self) -> str | None:
        """The origin host of a request another gateway forwarded (verified); None otherwise."""
        return self.forwarded.origin if self.forwarded is not None else None

    async def _ask_router(self, router: Router, session_id: str | None, kernel_id: str | None) -> None:
        self.route = await router.route(self, session_id, kernel_id)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every verb a handler defines runs through :meth:`_dispatch` (wrapped once, here)."""
        super().__init_subclass__(**kwargs)
        for name in HTTP_VERBS:
            verb = cls.__dict__.get(name)
            if verb is not None and not getattr(verb, "dispatches", False):
                setattr(cls, name, _dispatched(verb))

    async def _dispatch(self, verb: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the request's verb once its body is in, unless the request is answered otherwise:
        already refused (a body over the limit: the answer is out, this only ends it), or routed
        by the cluster to another host or to a lost session's record (:attr:`route`). A request
        another gateway forwarded runs only if its body is the one that gateway signed (401)."""
        if self._refusal is not None:
            if not self._finished:
                self.finish()
            return
        if self.route is not None:
            if not self._finished:
                await self.route.serve(self)
            return
        if self.forwarded is not None:
            self.forwarded.check_body(self.body)
        answer = verb(self, *args, **kwargs)
        if inspect.isawaitable(answer):
            await answer

    @property
    def cluster(self) -> ClusterSeam | None:
        """This gateway's cluster link; None on a single host."""
        return getattr(self.registry, "cluster", None)

    async def create_session(
        self, profile: str | None, limits: Mapping[str, Any], metadata: Mapping[str, Any], origin: str
    ) -> ManagedSession | None:
        """Create a session for the caller: what ``POST /api/sessions`` and ``POST /api/kernels``
        both do. In a cluster it is placed first (gateway/cluster/placement.py): None when it was
        placed on another host and that host's answer has been relayed (nothing left to write).
        A refusal at the tenant's limit (429, counted cluster-wide) is counted in the metrics."""
        if self.router is not None and await self.router.placed_elsewhere(self, profile, limits):
            return None
        try:
            return await self.registry.create(self.tenant, profile, limits, metadata, origin=origin)
        except TooManySessionsError:
            self.metrics.limit_hits.labels("sessions").inc()
            raise

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body is over the limit of {self.max_body_bytes} bytes", "too_large")

    def on_finish(self) -> None:
        self._uncount()

    def on_connection_close(self) -> None:
        self._uncount()
        if self.forwarding is not None:
            self.forwarding.cut()  # the owner sees its client gone, as a local handler would
        super().on_connection_close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            if self.traffic is not None:
                self.traffic.request_ended()

    def data_received(self, chunk: bytes) -> None:
        """Collect the body up to :attr:`max_body_bytes`; past it (a body sent without a
        Content-Length), answer the JSON 413 and drop the rest (:meth:`refuse_then_drain`)."""
        if self._finished or self._refusal is not None:
            return
        self._received += len(chunk)
        if self._received > self.max_body_bytes:
            self.refuse_then_drain(self._too_large())
            return
        self._chunks.append(chunk)

    def refuse_then_drain(self, refusal: ApiError) -> None:
        """Send ``refusal``'s JSON answer now, then read (and drop) the rest of the body before
        the request ends. A client that reads while it sends sees the 4xx at once; one that sends
        the whole body first must find the connection still open: closed with unread bytes in
        it, the kernel resets it, and the reset can reach the client before the answer does (a
        bare connection error instead of a 4xx saying what to fix, as a CI run's 5 MB MCP body
        got). Tornado's max_body_size and body_timeout bound what is read."""
        self._refusal = refusal
        self._chunks = []
        status, code, message = error_reply(refusal)
        payload = error_payload(code, message)
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Content-Length", str(len(payload)))
        self.write(payload)
        self.flush()  # the verb, once the body is in, only ends the request (_dispatch)

    @property
    def body(self) -> bytes:
        return b"".join(getattr(self, "_chunks", []))

    def authenticate(self) -> str:
        return authenticate_request(self, self.auth)

    def json_body(self) -> dict[str, Any]:
        """The request body as a JSON object; {} when empty; 400 when not an object."""
        raw = self.body
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise ApiError(400, f"request body is not valid JSON: {err}", "bad_json") from None
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to be read", "bad_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "bad_json")
        return body

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, default=str))

    def _handle_request_exception(self, e: BaseException) -> None:
        """Tornado sends every exception a handler raises here; a SandkernelError gets its own
        status (tornado would make it a 500) and the same JSON as any other error. A session
        closed under a request because the gateway is stopping is a 503 (retry: the next process
        has it), not a 404."""
        if isinstance(e, SessionClosedError) and self.registry is not None and self.registry.stopping:
            if not self._finished:
                restarting = restarting_error()
                self.send_error(503, exc_info=(type(restarting), restarting, None))
            return
        if isinstance(e, SandkernelError):
            self.log_exception(type(e), e, e.__traceback__)
            if not self._finished:
                self.send_error(e.http_status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if exc is None:
            code = phrase_code(status_code)
            message = code.replace("_", " ")
        else:
            _, code, message = error_reply(exc)
        retry_after = retry_after_of(exc)
        if retry_after is not None:
            self.set_header("Retry-After", str(retry_after))
        self.set_header("Content-Type", "application/json")
        self.finish(error_payload(code, message))

    def log_exception(self, typ, value, tb) -> None:  # type: ignore[no-untyped-def]
        """Refusals (4xx) are the client's business: not logged here (the access log has them).
        A SandkernelError 5xx is an infrastructure failure with a message: one line. Anything
        else is a bug: one line with its traceback."""
        status = error_reply(value)[0] if value is not None else 500
        if isinstance(value, (SandkernelError, web.HTTPError)):
            if status >= 500:
                log.error("%s %s failed: %s (%d)", self.request.method, self.request.path, value, status)
            return
        log.error("bug: %s %s raised", self.request.method, self.request.path, exc_info=(typ, value, tb))


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        raise ApiError(404, f"no such endpoint: {self.request.path}; see /api/openapi.json")
