"""The one exception tree of sandkernel.

Every failure of the infrastructure (Docker, the image, the runtime, the transport) raises a
subclass of :class:`SandkernelError` whose message says what to fix. Errors in the *user's*
code are not exceptions: they are data in an :class:`~sandkernel.kernels.execution.outputs.ExecutionResult`.
Built-in bases are mixed in where the meaning matches, so callers may catch either.
"""

from __future__ import annotations


class SandkernelError(Exception):
    """Root of every error sandkernel raises on purpose.

    ``code`` is the machine-readable name an API error carries (``{"error": code}``); None lets
    the gateway derive one from the class name."""

    code: str | None = None


class ConfigError(SandkernelError, ValueError):
    """A setting or argument has a value sandkernel cannot use (bad profile value, bad type)."""


class UnknownProfileError(ConfigError, LookupError):
    """A profile name that is not defined."""


class SettingNotPermittedError(ConfigError, PermissionError):
    """A tenant asked for a setting only the operator may choose (an image, a host directory, a
    runtime the profile does not offer, more network than granted)."""

    code = "not_permitted"


class DockerUnavailableError(SandkernelError):
    """The Docker engine cannot be reached."""


class ImageNotFoundError(SandkernelError, LookupError):
    """The kernel image does not exist locally (sandkernel never pulls at session start)."""


class RuntimeUnavailableError(SandkernelError):
    """The requested container runtime (e.g. runsc) is not registered with Docker."""


class KernelStartError(SandkernelError):
    """The sandboxed kernel did not come up (container or ipykernel failed)."""


class TransportError(SandkernelError):
    """The kernel's sockets are not what the host expects (e.g. a symlink): refused, never followed."""


class KernelNotFoundError(SandkernelError, LookupError):
    """No kernel or session with that id (or it belongs to someone else)."""


class SessionClosedError(SandkernelError):
    """The session was shut down; start a new one."""


class ImageBuildError(SandkernelError):
    """Building the kernel image (or its base) failed."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type (e.g. code that is not a string)."""
