"""The one exception tree of sandkernel.

Every failure of the infrastructure (Docker, the image, the runtime, the transport) raises a
subclass of :class:`SandkernelError` whose message says what to fix. Errors in the *user's*
code are not exceptions: they are data in an :class:`~sandkernel.kernels.execution.outputs.ExecutionResult`.
Built-in bases are mixed in where the meaning matches, so callers may catch either.

Each class carries what an API reply says about it, as class attributes: ``status`` (the HTTP
status) and ``code`` (the machine-readable ``{"error": code}``). The gateway maps every
SandkernelError through these two attributes in one place (``gateway/base.py``'s
``error_reply``), so a new error class needs no handler change. A class that sets no ``code``
gets one from its name (``UnknownProfileError`` -> ``unknownprofile``), as it always had; a
subclass inherits its parent's ``status``. An error whose instances carry their own ``code``
(the sandbox's file refusals: ``not_found``, ``too_large``, ...) takes the status of that code
from :data:`STATUS_FOR_CODE`, which holds the codes that mean the same everywhere in the API.
An error that will likely pass by itself carries ``retry_after`` (seconds): the gateway sends it
as ``Retry-After``, so clients wait instead of hammering (the engine restarting, a start breaker
that is open, a gateway that is restarting).
"""

from __future__ import annotations

# Codes that name the same condition wherever they appear, and the status that goes with them.
STATUS_FOR_CODE: dict[str, int] = {
    "not_found": 404,
    "too_large": 413,
    "not_permitted": 403,
    "permission_denied": 403,
}


class SandkernelError(Exception):
    """Root of every error sandkernel raises on purpose.

    ``status`` is the HTTP status an API reply gives it; ``code`` the machine-readable name it
    carries (``{"error": code}``). A bare SandkernelError is an infrastructure failure with a
    message for people (a kernel that would not list its variables): 500."""

    status: int = 500
    code: str = "sandkernel_error"
    # Seconds after which the same request may well succeed (sent as Retry-After); None: no hint.
    retry_after: float | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            cls.code = cls.__name__.removesuffix("Error").lower() or "sandkernel_error"

    @property
    def http_status(self) -> int:
        """The status of this error: its code's, where the code is a shared one, else its class's."""
        return STATUS_FOR_CODE.get(self.code, self.status)


class ConfigError(SandkernelError, ValueError):
    """A setting or argument has a value sandkernel cannot use (bad profile value, bad type)."""

    status = 400


class TooLargeError(ConfigError):
    """A tenant's setting or value over its documented size (session metadata)."""

    status = 413
    code = "too_large"


class UnknownProfileError(ConfigError, LookupError):
    """A profile name that is not defined."""


class SettingNotPermittedError(ConfigError, PermissionError):
    """A tenant asked for a setting only the operator may choose (an image, a host directory, a
    runtime the profile does not offer, more network than granted)."""

    status = 403
    code = "not_permitted"


class DockerUnavailableError(SandkernelError):
    """The Docker engine cannot be reached."""

    status = 503
    retry_after = 5.0  # a restarting dockerd is back within seconds (live-restore keeps the sandboxes)


class EngineUnavailableError(DockerUnavailableError):
    """New sandboxes are refused at once: starts kept failing or were too slow (the Docker engine
    is down or overloaded), so the gateway's start breaker is open (gateway/breakers.py).
    Nothing was started; retry after ``retry_after`` seconds, when the breaker tries again.
    Existing sessions are not affected."""

    code = "sandbox_engine_unavailable"

    def __init__(self, message: str, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ClusterUnavailableError(SandkernelError):
    """The cluster's shared catalog (PostgreSQL) or the host that holds a session cannot be
    reached right now. What needs it (placing a new session, forwarding to another host) is
    refused at once; the sessions this host holds keep working. Retry after ``retry_after``."""

    status = 503
    code = "cluster_unavailable"
    retry_after = 5.0


class ImageNotFoundError(SandkernelError, LookupError):
    """The kernel image does not exist locally (sandkernel never pulls at session start)."""

    status = 400


class RuntimeUnavailableError(SandkernelError):
    """The requested container runtime (e.g. runsc) is not registered with Docker."""

    status = 400


class KernelStartError(SandkernelError):
    """The sandboxed kernel did not come up (container or ipykernel failed)."""

    status = 503


class TransportError(SandkernelError):
    """The kernel's sockets are not what the host expects (e.g. a symlink): refused, never followed."""


class KernelNotFoundError(SandkernelError, LookupError):
    """No kernel or session with that id (or it belongs to someone else)."""

    status = 404
    code = "not_found"


class SessionClosedError(SandkernelError):
    """The session was shut down (deleted or culled while a request for it was under way); start a
    new one. For a client it is gone: 404, with a message saying it was shut down."""

    status = 404
    code = "session_closed"


class SessionDetachedError(SessionClosedError):
    """The gateway is restarting and has let go of the session, which keeps running: the request
    was not run; send it again once the gateway is back (a few seconds)."""

    status = 503
    code = "gateway_restarting"
    retry_after = 2.0


class ImageBuildError(SandkernelError):
    """Building the kernel image (or its base) failed."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type (e.g. code that is not a string)."""


class SandboxLostError(SandkernelError):
    """A session's sandbox died or was removed while no gateway was attached to it (the reason
    says how: exit code, OOM kill, removed). The session stays listed, in state ``lost``,
    until it is deleted; its workspace disk is kept until then."""

    status = 410
    code = "sandbox_lost"


class AdoptionRefusedError(SandkernelError):
    """A recorded sandbox is not what the catalog says (labels, image, runtime dir or sockets
    differ): the gateway refuses to talk to it and leaves it alone for an operator to look at."""

    status = 409
    code = "adoption_refused"


class SnapshotError(SandkernelError):
    """A snapshot could not be made or used (pause, resume, fork, rewind); the message says why
    and what the session's state is now."""

    status = 409
    code = "snapshot_failed"


class SnapshotRejectedError(SnapshotError):
    """A snapshot on disk failed its check (altered, truncated, or not this tenant's or this
    session's): it is never restored."""

    code = "snapshot_rejected"


class ReplayRefusedError(SnapshotError):
    """A replay would re-run cells that reached beyond the sandbox (the network, a shell), and
    the operator refuses such replays (``--replay-side-effects refuse``)."""

    code = "replay_refused"


class SnapshotQuotaError(SnapshotError):
    """A new snapshot would take a tenant past its snapshot disk quota."""

    code = "snapshot_quota_exceeded"


class SessionPausedError(SandkernelError):
    """The call needs the kernel of a paused session (interrupt, restart, the kernel API): resume it
    first. Executes and file calls resume it by themselves."""

    status = 409
    code = "session_paused"


class SessionBusyError(SandkernelError):
    """A snapshot (pause, fork, rewind) of a session that is running code: it would not be the
    state of any cell."""

    status = 409
    code = "session_busy"


class HelperKilledError(SandkernelError):
    """A helper the gateway ran in the sandbox (a file operation) was killed there before it
    answered: the session's own code stopped or killed it, or the sandbox ran out of memory."""

    status = 409
    code = "sandbox_helper_killed"


class KernelAnswerError(SandkernelError):
    """The kernel answered a question of the gateway's (its variables) with something that is not
    the answer: the session's own code replaced or broke what answers it. The session's doing, so
    a conflict with its state, as a helper its code killed is."""

    status = 409
    code = "kernel_answer_invalid"


class HelpersBusyError(SandkernelError):
    """A session already has as many helper calls (file operations, signals) running or waiting
    as it may: the call is refused at once instead of queueing without bound."""

    status = 429
    retry_after = 1.0
