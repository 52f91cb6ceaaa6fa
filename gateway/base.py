"""What every gateway handler shares: auth, JSON bodies, and errors that never leak a traceback.

Errors are JSON ``{"error": code, "message": sentence}`` with the right status. sandkernel's
own exceptions map to statuses here, once; anything unexpected becomes a 500 whose message says
only that it was logged (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from tornado import web

from sandkernel.errors import (
    ConfigError,
    DockerUnavailableError,
    ImageNotFoundError,
    KernelNotFoundError,
    KernelStartError,
    RuntimeUnavailableError,
    SandkernelError,
    SessionClosedError,
    SettingNotPermittedError,
)
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.registry import SessionRegistry, TooManySessionsError

log = logging.getLogger(__name__)

# Most specific first.
STATUS_FOR_ERROR: list[tuple[type[Exception], int]] = [
    (TooManySessionsError, 429),
    (KernelNotFoundError, 404),
    (SessionClosedError, 404),
    (SettingNotPermittedError, 403),
    (ImageNotFoundError, 400),
    (RuntimeUnavailableError, 400),
    (ConfigError, 400),
    (DockerUnavailableError, 503),
    (KernelStartError, 503),
    (SandkernelError, 500),
]


class ApiError(web.HTTPError):
    """An HTTP error with a machine code and a sentence for people."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(status, reason=HTTPStatus(status).phrase)
        self.message = message
        self.code = code or HTTPStatus(status).phrase.lower().replace(" ", "_")


def api_error_from(err: SandkernelError) -> ApiError:
    for cls, status in STATUS_FOR_ERROR:
        if isinstance(err, cls):
            code = err.code or type(err).__name__.removesuffix("Error").lower() or None
            return ApiError(status, str(err), code=code)
    return ApiError(500, str(err))


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
    address = handler.request.remote_ip or "unknown"
    wait = auth.failures.retry_after(address)
    if wait is not None:
        handler.set_header("Retry-After", str(int(wait) + 1))
        raise ApiError(
            429, f"too many failed authentications from {address}; retry in {int(wait) + 1}s", "too_many_failures"
        )
    auth.failures.record_failure(address)
    if query_token and not auth.allow_query_token and not header:
        raise ApiError(
            401,
            "tokens in the URL are refused (URLs end up in logs): send 'Authorization: token <TOKEN>', "
            "or start the gateway with --allow-token-in-url",
            "unauthorized",
        )
    raise ApiError(401, "missing or wrong token: send 'Authorization: token <TOKEN>'", "unauthorized")


# Request bodies larger than this get a JSON 413 (checked on Content-Length, then while reading).
MAX_BODY_BYTES = 40 * 1024 * 1024


@web.stream_request_body
class BaseHandler(web.RequestHandler):
    """Thin handlers: dependencies come through ``initialize``; subclasses implement verbs.

    Bodies are streamed in so an oversized one is refused with a JSON 413 before it is read;
    handlers use :attr:`body`.
    """

    registry: SessionRegistry
    auth: TokenAuth | None
    settings_: dict[str, Any]
    tenant: str

    def initialize(self, registry: SessionRegistry, auth: TokenAuth | None, config: dict[str, Any]) -> None:
        self.registry = registry
        self.auth = auth
        self.settings_ = config

    def prepare(self) -> None:
        stream = self.request.connection.stream if self.request.connection else None
        if stream is not None:
            stream.set_nodelay(True)
        self._chunks: list[bytes] = []
        self._received = 0
        self.tenant = self.authenticate()
        declared = self.request.headers.get("Content-Length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is over the limit of {MAX_BODY_BYTES} bytes", "too_large")

    def data_received(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._received > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is over the limit of {MAX_BODY_BYTES} bytes", "too_large")
        self._chunks.append(chunk)

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
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "bad_json")
        return body

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, default=str))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            body = {"error": exc.code, "message": exc.message}
        elif isinstance(exc, web.HTTPError):
            phrase = HTTPStatus(status_code).phrase
            body = {"error": phrase.lower().replace(" ", "_"), "message": exc.log_message or exc.reason or phrase}
        else:
            body = {"error": "internal_error", "message": "the gateway hit an unexpected error; it has been logged"}
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def log_exception(self, typ, value, tb) -> None:  # type: ignore[no-untyped-def]
        if isinstance(value, web.HTTPError) and value.status_code < 500:
            return
        super().log_exception(typ, value, tb)

    async def call(self, awaitable):  # type: ignore[no-untyped-def]
        """Await a session-layer coroutine, turning sandkernel errors into API errors."""
        try:
            return await awaitable
        except SandkernelError as err:
            raise api_error_from(err) from err


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        raise ApiError(404, f"no such endpoint: {self.request.path}; see /api/openapi.json")
