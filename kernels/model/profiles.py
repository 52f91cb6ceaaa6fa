"""Named resource and isolation profiles for sandboxed kernels.

A :class:`Profile` is the single source of every limit a kernel container gets: memory, CPU,
pids, tmpfs sizes, ulimits, runtime and image. Profiles are validated once, here, so the
container layer can trust them. Per-session overrides go through :func:`resolve_profile`,
which names the field and the accepted range in its error.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any

from sandkernel import __version__
from sandkernel.errors import ConfigError, UnknownProfileError
from sandkernel.kernels.egress.policy import EgressPolicy

DEFAULT_IMAGE = f"sandkernel-kernel:{__version__}"


class Runtime(str, enum.Enum):
    """OCI runtimes sandkernel will launch kernels with."""

    RUNC = "runc"
    RUNSC = "runsc"  # gVisor


class WorkspaceStorage(str, enum.Enum):
    """What backs a sandbox's /workspace (see kernels/sandbox/workspace_disk.py)."""

    DISK = "disk"  # its own ext4 image: a hard quota, kept across container replacement; needs root
    MEMORY = "memory"  # a tmpfs: charged to the sandbox's memory limit, gone with the container


@dataclasses.dataclass(frozen=True)
class Profile:
    """Limits and isolation settings for one kernel container.

    Sizes are MiB, times float seconds, ``cpus`` a fraction of host cores.
    """

    name: str = "default"
    image: str = DEFAULT_IMAGE
    runtime: Runtime = Runtime.RUNC
    memory_mb: int = 1024
    cpus: float = 1.0
    pids: int = 256
    tmp_mb: int = 256
    workspace_mb: int = 1024
    workspace_storage: WorkspaceStorage = WorkspaceStorage.DISK
    nofile: int = 1024
    fsize_mb: int = 1024
    start_timeout: float = 60.0
    execute_timeout: float = 120.0
    interrupt_grace: float = 3.0
    wheelhouse: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    network: EgressPolicy | None = None  # None: no network at all; else an allowlist via the proxy

    def to_dict(self, public: bool = False) -> dict[str, Any]:
        """JSON-friendly form, for notebook metadata and API replies. ``public`` (what tenants
        see) leaves out host paths and the operator's environment (:data:`HOST_DETAILS`)."""
        data = dataclasses.asdict(self)
        data["runtime"] = self.runtime.value
        data["workspace_storage"] = self.workspace_storage.value
        data["env"] = dict(self.env)
        data["network"] = self.network.to_dict() if self.network else "none"
        if public:
            for key in HOST_DETAILS:
                data.pop(key)
        return data


# Settings whose values are the operator's (a host directory, environment that may hold
# credentials): never shown to tenants in API replies.
HOST_DETAILS = ("wheelhouse", "env")


# field -> (minimum, maximum) for numeric settings; the error message quotes them.
NUMERIC_RANGES: dict[str, tuple[float, float]] = {
    "memory_mb": (64, 65536),
    "cpus": (0.05, 64),
    "pids": (16, 32768),
    "tmp_mb": (1, 65536),
    "workspace_mb": (1, 262144),
    "nofile": (64, 1048576),
    "fsize_mb": (1, 1048576),
    "start_timeout": (1, 3600),
    "execute_timeout": (0.1, 86400),
    "interrupt_grace": (0.1, 600),
}

PROFILES: dict[str, Profile] = {
    "default": Profile(),
    "small": Profile(name="small", memory_mb=512, cpus=0.5, pids=128, tmp_mb=64, workspace_mb=256),
    "large": Profile(name="large", memory_mb=4096, cpus=2.0, pids=1024, tmp_mb=1024, workspace_mb=8192),
}


def check_setting(name: str, value: Any) -> Any:
    """One setting's value, validated and converted (a Runtime, an int, a policy...); a
    :class:`ConfigError` names the setting and what it accepts. Every door checks through here."""
    field_types = {f.name: f.type for f in dataclasses.fields(Profile)}
    if name not in field_types:
        allowed = ", ".join(sorted(f for f in field_types if f != "name"))
        raise ConfigError(f"unknown profile setting {name!r}; known settings: {allowed}")
    if name == "runtime":
        try:
            return Runtime(value)
        except ValueError:
            raise ConfigError(f"runtime must be one of {[r.value for r in Runtime]}, not {value!r}") from None
    if name == "workspace_storage":
        try:
            return WorkspaceStorage(value)
        except ValueError:
            allowed = [s.value for s in WorkspaceStorage]
            raise ConfigError(f"workspace_storage must be one of {allowed}, not {str(value)[:64]!r}") from None
    if name in NUMERIC_RANGES:
        low, high = NUMERIC_RANGES[name]
        integral = name not in ("cpus", "start_timeout", "execute_timeout", "interrupt_grace")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (integral and not float(value).is_integer())
        ):
            kind = "a whole number" if integral else "a number"
            raise ConfigError(f"profile setting {name} must be {kind}, not {value!r}")
        if not low <= value <= high:
            raise ConfigError(f"profile setting {name}={value} is out of range; use {low:g} to {high:g}")
        return int(value) if integral else float(value)
    if name == "image":
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"image must be a non-empty image reference, not {value!r}")
        return value
    if name == "wheelhouse":
        if value is not None and (not isinstance(value, str) or not os.path.isabs(value)):
            raise ConfigError(f"wheelhouse must be an absolute host directory path, not {value!r}")
        if value is not None and not os.path.isdir(value):
            raise ConfigError(f"wheelhouse directory {value!r} does not exist on the host")
        return value
    if name == "network":
        return EgressPolicy.from_config(value)
    if name == "env":
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError("env must be a mapping of strings to strings")
        return dict(value)
    raise ConfigError(f"profile setting {name!r} cannot be overridden")


def resolve_profile(name: str | Profile | None = None, overrides: Mapping[str, Any] | None = None) -> Profile:
    """Return the named profile with validated per-session overrides applied.

    ``name`` may also be a :class:`Profile` already resolved (the gateway's catalog hands those
    out): it is used as it is, with ``overrides`` on top. For a name, ``SANDKERNEL_IMAGE`` and
    ``SANDKERNEL_RUNTIME`` (read now, not at import) override the profile's image and runtime,
    so standard Jupyter tools can pick gVisor or a custom image.
    Raises :class:`UnknownProfileError` or :class:`ConfigError` with the fix in the message.
    """
    changes: dict[str, Any] = {}
    if isinstance(name, Profile):
        base = name
    else:
        name = name or os.environ.get("SANDKERNEL_PROFILE") or "default"
        if not isinstance(name, str) or name not in PROFILES:
            raise UnknownProfileError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
        base = PROFILES[name]
        for env_name, field in (("SANDKERNEL_IMAGE", "image"), ("SANDKERNEL_RUNTIME", "runtime")):
            if os.environ.get(env_name):
                changes[field] = check_setting(field, os.environ[env_name])
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"profile overrides must be a mapping, not {type(overrides).__name__}")
    for key, value in (overrides or {}).items():
        changes[key] = check_setting(key, value)
    return dataclasses.replace(base, **changes)
