"""Exceptions of the Python client, one per failure kind, so callers can catch what they handle.

Here: the gateway refused or could not serve a request (:class:`ClientError` and its
HTTP-status subclasses, :class:`GatewayUnreachableError`, :class:`RequestTimeoutError`). Code
that ran but did not finish well has its exceptions beside its result, in agent/execution.py
(:class:`~sandkernel.agent.execution.ExecutionFailed` and its subclasses,
:class:`~sandkernel.agent.execution.GatewayRestarted`): they carry the Execution, which this
module, imported by it, does not name.
"""

from __future__ import annotations

from sandkernel import errors as gateway_errors


class ClientError(Exception):
    """The gateway answered with an error. ``status`` is the HTTP status (0 when there was none),
    ``code`` the gateway's machine code, ``message`` its sentence saying what to fix."""

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(f"{message} (HTTP {status})" if status else message)
        self.message = message
        self.status = status
        self.code = code


class BadRequestError(ClientError, ValueError):
    """400/422: an argument the gateway cannot use (the message names it)."""


class AuthenticationError(ClientError, PermissionError):
    """401/403: no token, or a wrong one. Set SANDKERNEL_TOKEN or pass ``token=``."""


class NotFoundError(ClientError, LookupError):
    """404: no such session or file, or it belongs to another token."""


class ConflictError(ClientError):
    """409: the request conflicts with the resource's state."""


class LimitExceededError(ClientError):
    """413/429: a size or count limit was hit (body, file, sessions per token)."""


class GatewayError(ClientError):
    """5xx: the gateway or Docker behind it failed; retrying later may help."""


class GatewayUnreachableError(ClientError, ConnectionError):
    """No connection to the gateway (after the retries allowed for the call). ``sent`` is False
    when the connection was refused, so the request never reached a gateway (safe to send again)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class SandboxLostError(NotFoundError):
    """410: the session's sandbox died while no gateway was attached to it (the message says
    why: exit code, OOM kill, removed by hand); the session is listed as ``lost``, not usable."""


class RequestTimeoutError(ClientError, TimeoutError):
    """The gateway did not answer within the client's request timeout."""


class SnapshotFailedError(ConflictError):
    """409 ``snapshot_failed``: a pause, resume, fork or rewind could not be done. The message
    says why and what the session's state is now (a pause that failed leaves it running), so the
    caller can decide whether to go on with the session as it is."""


class SnapshotRejectedError(SnapshotFailedError):
    """409 ``snapshot_rejected``: the snapshot on disk failed its check (altered, truncated, or
    not this tenant's or this session's), so the gateway refused to restore it. Trying again
    gives the same answer; the state it held is not recoverable through the gateway."""


class SnapshotQuotaError(SnapshotFailedError, LimitExceededError):
    """409 ``snapshot_quota_exceeded``: a new snapshot would take the tenant past its snapshot
    disk quota. Also a :class:`LimitExceededError`, since freeing room (deleting paused
    sessions or forks no longer needed) is what helps, as with the other limits."""


class SessionPausedError(ConflictError):
    """409 ``session_paused``: the call needs a running kernel and the session is paused. Call
    :meth:`resume` first (execute, shell and file calls resume a paused session by themselves)."""


class SessionBusyError(ConflictError):
    """409 ``session_busy``: a pause, fork or rewind asked while the session runs code; a snapshot
    then would be the state of no cell. Wait for the execution to end (or interrupt it), then ask again."""


STATUS_ERRORS: dict[int, type[ClientError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    410: SandboxLostError,
    413: LimitExceededError,
    422: BadRequestError,
    429: LimitExceededError,
}

# Gateway codes that say more than their status: checked before STATUS_ERRORS. The codes come from
# the gateway's own error classes (sandkernel.errors, the common base), so the two ends cannot
# drift apart.
CODE_ERRORS: dict[str, type[ClientError]] = {
    gateway_errors.SnapshotError.code: SnapshotFailedError,
    gateway_errors.SnapshotRejectedError.code: SnapshotRejectedError,
    gateway_errors.SnapshotQuotaError.code: SnapshotQuotaError,
    gateway_errors.SessionPausedError.code: SessionPausedError,
    gateway_errors.SessionBusyError.code: SessionBusyError,
}


def error_for_status(status: int, message: str, code: str = "") -> ClientError:
    """The exception for a failed reply: by the gateway's machine ``code`` where it names a kind the
    caller can act on (:data:`CODE_ERRORS`), else by the HTTP ``status``."""
    cls = CODE_ERRORS.get(code) or STATUS_ERRORS.get(status) or (GatewayError if status >= 500 else ClientError)
    return cls(message, status, code)
