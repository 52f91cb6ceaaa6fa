"""The operator's profiles, and what a tenant may ask of them.

Every setting of a :class:`Profile` belongs to one of two owners:

- **operator-owned** (:data:`OPERATOR_SETTINGS`): the image, a host wheelhouse directory, the
  sandbox environment. They reach into the host (a wheelhouse is a host path mounted into the
  sandbox; an image is any local image; ``env`` can change how the kernel starts), so only the
  operator sets them, in a profiles file (``sandkernel serve --profiles FILE``).
- **tenant-narrowable** (:data:`TENANT_SETTINGS`): resource limits, timeouts and disk sizes, each
  up to the profile's ceiling; the runtime, among those the profile lets tenants pick (gVisor is
  always allowed, runc only where the operator lists it); and the network, only ever narrower
  than what the profile or the operator's egress policy grants; and the workspace storage
  (``disk`` or ``memory``), either way: a memory workspace costs only the tenant's own memory
  limit, a disk one only up to its ``workspace_mb`` ceiling of the host's disk.

A request for an operator-owned setting, a runtime the profile does not offer, or more network
than granted raises :class:`SettingNotPermittedError` (HTTP 403); a value over a ceiling raises
:class:`ConfigError` naming the setting and the allowed range (HTTP 400). The Python API
(``KernelSession.start(overrides=...)``) bypasses all of this on purpose: it is the operator's code.

Profiles file (JSON): profile name -> settings, ``ceilings`` and ``extends`` (the profile it starts
from, default ``default``); ``null`` removes a built-in profile::

    {"default": {"runtime": "runsc", "ceilings": {"memory_mb": 2048, "runtimes": ["runsc"]}},
     "analyst": {"extends": "large", "wheelhouse": "/srv/wheels", "env": {"TZ": "UTC"}},
     "small": null}
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandkernel.errors import ConfigError, SettingNotPermittedError, UnknownProfileError
from sandkernel.kernels.egress.policy import BadNetworkError, EgressNotPermitted, EgressPolicy
from sandkernel.kernels.model.profiles import NUMERIC_RANGES, PROFILES, Profile, Runtime, check_setting
from sandkernel.kernels.sandbox.docker_engine import default_engine

OPERATOR_SETTINGS = frozenset({"image", "wheelhouse", "env"})
LIMIT_SETTINGS = (
    "memory_mb",
    "cpus",
    "pids",
    "tmp_mb",
    "workspace_mb",
    "nofile",
    "fsize_mb",
    "start_timeout",
    "execute_timeout",
    "interrupt_grace",
)
TENANT_SETTINGS = frozenset({*LIMIT_SETTINGS, "runtime", "network", "workspace_storage"})

# What a tenant may raise a limit to when the operator set no ceiling: the built-in "large"
# profile's sizes and generous but finite times. A profile whose own value is higher keeps it
# as its ceiling (a tenant can always ask for what the profile gives by default).
DEFAULT_CEILINGS: Mapping[str, float] = {
    "memory_mb": 4096,
    "cpus": 2.0,
    "pids": 1024,
    "tmp_mb": 1024,
    "workspace_mb": 8192,
    "nofile": 4096,
    "fsize_mb": 8192,
    "start_timeout": 120.0,
    "execute_timeout": 3600.0,
    "interrupt_grace": 30.0,
}
FILE_KEYS = frozenset({"extends", "ceilings"})


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """The most a tenant may ask of one profile: a maximum per limit, and the runtimes offered."""

    limits: Mapping[str, float]
    runtimes: frozenset[Runtime]

    def to_dict(self) -> dict[str, Any]:
        return {**self.limits, "runtimes": sorted(r.value for r in self.runtimes)}


def _ceilings_for(profile: Profile, configured: Any, where: str) -> Ceilings:
    """Ceilings from a profiles-file entry (or none), checked against the profile's own values."""
    if configured is None:
        configured = {}
    if not isinstance(configured, Mapping):
        raise ConfigError(f'{where}: ceilings must be an object such as {{"memory_mb": 2048}}')
    unknown = set(configured) - set(LIMIT_SETTINGS) - {"runtimes"}
    if unknown:
        raise ConfigError(f"{where}: unknown ceilings {sorted(unknown)}; known: {[*LIMIT_SETTINGS, 'runtimes']}")
    limits: dict[str, float] = {}
    for name in LIMIT_SETTINGS:
        own = getattr(profile, name)
        if name in configured:
            limit = check_setting(name, configured[name])
            if limit < own:
                raise ConfigError(f"{where}: ceiling {name}={limit:g} is below the profile's own value {own:g}")
        else:
            limit = max(DEFAULT_CEILINGS[name], own)
        limits[name] = limit
    runtimes = configured.get("runtimes")
    if runtimes is None:
        offered = {profile.runtime, Runtime.RUNSC}  # gVisor is never a downgrade
    elif isinstance(runtimes, list) and runtimes:
        offered = {check_setting("runtime", r) for r in runtimes}
    else:
        raise ConfigError(f'{where}: ceilings.runtimes must be a non-empty list such as ["runsc"]')
    if profile.runtime not in offered:
        raise ConfigError(f"{where}: ceilings.runtimes must include the profile's own runtime {profile.runtime.value}")
    return Ceilings(limits, frozenset(offered))


async def choose_default_runtime(choice: str | None = None) -> Runtime:
    """``auto`` (secure by default): gVisor where runsc is registered with Docker, else runc.
    ``runc``/``runsc`` are the operator's explicit choice (``--default-runtime``); None means
    ``$SANDKERNEL_RUNTIME`` (read now), else ``auto``."""
    choice = choice or os.environ.get("SANDKERNEL_RUNTIME") or "auto"
    if choice != "auto":
        return check_setting("runtime", choice)
    engine = default_engine()
    registered = await engine.run(engine.runtimes_sync)
    return Runtime.RUNSC if Runtime.RUNSC.value in registered else Runtime.RUNC


class ProfileCatalog:
    """The profiles a gateway offers, their ceilings, and the check of every tenant request."""

    def __init__(
        self,
        profiles: Mapping[str, Profile],
        ceilings: Mapping[str, Ceilings],
        egress_policy: EgressPolicy | None = None,
    ) -> None:
        if "default" not in profiles:
            raise ConfigError('the profiles must include one named "default" (sessions that name none get it)')
        self.profiles = dict(profiles)
        self.ceilings = dict(ceilings)
        self.egress_policy = egress_policy

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        default_runtime: Runtime = Runtime.RUNC,
        egress_policy: EgressPolicy | None = None,
    ) -> ProfileCatalog:
        """The built-in profiles, changed by the operator's profiles file when one is given.

        ``default_runtime`` is the runtime of every profile that does not set its own in the
        file. Raises :class:`ConfigError` naming the profile and setting at fault."""
        entries: Mapping[str, Any] = {}
        if path is not None:
            try:
                entries = json.loads(Path(path).read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"cannot read the profiles file {path}: {err}") from err
            if not isinstance(entries, Mapping):
                raise ConfigError(f"profiles file {path} must be a JSON object: profile name -> settings")
        names = [n for n in PROFILES if n not in entries] + list(entries)
        profiles: dict[str, Profile] = {}
        ceilings: dict[str, Ceilings] = {}
        for name in names:
            entry = entries.get(name, {})
            if entry is None:
                continue  # the operator removed this built-in profile
            where = f"profile {name!r}"
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{where}: settings must be a JSON object (or null to remove it)")
            profile = cls._build(name, entries, default_runtime)
            profiles[name] = profile
            ceilings[name] = _ceilings_for(profile, entry.get("ceilings"), where)
        return cls(profiles, ceilings, egress_policy)

    @staticmethod
    def _build(
        name: str, entries: Mapping[str, Any], default_runtime: Runtime, seen: frozenset[str] = frozenset()
    ) -> Profile:
        """One profile: its base first (``extends``; else the built-in of the same name; else
        ``default``), then the file's settings for it. The base's file settings apply too."""
        where = f"profile {name!r}"
        if name in seen:
            raise ConfigError(f"{where}: 'extends' makes a cycle")
        entry = entries.get(name, {})
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} is not defined (or was removed with null)")
        parent = entry.get("extends")
        if parent is not None:
            if not isinstance(parent, str) or (parent not in entries and parent not in PROFILES):
                raise ConfigError(f"{where}: extends unknown profile {parent!r}")
            base = ProfileCatalog._build(parent, entries, default_runtime, seen | {name})
        elif name in PROFILES:
            image = os.environ.get("SANDKERNEL_IMAGE")  # an operator's setting, read at load
            base = dataclasses.replace(PROFILES[name], runtime=default_runtime, **({"image": image} if image else {}))
        else:
            base = ProfileCatalog._build("default", entries, default_runtime, seen | {name})
        settings: dict[str, Any] = {}
        for key, value in entry.items():
            if key in FILE_KEYS:
                continue
            if key == "name":
                raise ConfigError(f"{where}: 'name' is the profile's key in the file, not a setting")
            try:
                settings[key] = check_setting(key, value)
            except ConfigError as err:
                raise ConfigError(f"{where}: {err}") from None
        return dataclasses.replace(base, name=name, **settings)

    # -- what tenants see and ask ---------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Every profile with its defaults and ceilings (``GET /api/profiles``); host paths and
        the operator's environment are left out."""
        return {
            name: {
                "defaults": {k: v for k, v in profile.to_dict(public=True).items() if k != "name"},
                "ceilings": self.ceilings[name].to_dict(),
            }
            for name, profile in self.profiles.items()
        }

    def profile(self, name: str | None) -> Profile:
        """The named profile as the operator defined it (no tenant changes)."""
        name = "default" if name is None else name
        if not isinstance(name, str) or name not in self.profiles:
            shown = name if isinstance(name, str) and len(name) <= 64 else "(that name)"
            raise UnknownProfileError(f"unknown profile {shown!r}; choose one of {sorted(self.profiles)}")
        return self.profiles[name]

    def for_tenant(self, name: str | None, request: Mapping[str, Any] | None) -> Profile:
        """The profile a tenant gets for ``name`` with the settings it asked for (``limits``).

        Raises UnknownProfileError, SettingNotPermittedError (operator-owned setting, a runtime
        not offered, more network than granted) or ConfigError (bad value, over a ceiling)."""
        profile = self.profile(name)
        ceilings = self.ceilings[profile.name]
        if request is None:
            request = {}
        if not isinstance(request, Mapping):
            raise ConfigError(f"limits must be a JSON object, not {type(request).__name__}")
        operator_owned = sorted(k for k in request if k in OPERATOR_SETTINGS or k == "name")
        if operator_owned:
            raise SettingNotPermittedError(
                f"{', '.join(operator_owned)} can only be set by the operator, in a profile of the profiles file "
                f"(sandkernel serve --profiles FILE); pick a profile instead: {sorted(self.profiles)}"
            )
        changes: dict[str, Any] = {}
        for key, value in request.items():
            if key not in TENANT_SETTINGS:
                raise ConfigError(f"unknown setting {str(key)[:64]!r}; a session may set {sorted(TENANT_SETTINGS)}")
            if key == "network":
                changes["network"] = self._network_for(profile, value)
                continue
            checked = check_setting(key, value)
            if key == "runtime":
                if checked not in ceilings.runtimes:
                    offered = sorted(r.value for r in ceilings.runtimes)
                    raise SettingNotPermittedError(
                        f"runtime {checked.value} is not offered by profile {profile.name!r}; "
                        f"it offers {offered} (the operator decides, in the profiles file)"
                    )
            elif key in LIMIT_SETTINGS:
                ceiling = ceilings.limits[key]
                if checked > ceiling:
                    low = NUMERIC_RANGES[key][0]
                    raise ConfigError(
                        f"{key}={checked:g} is over profile {profile.name!r}'s ceiling; use {low:g} to {ceiling:g}"
                    )
            changes[key] = checked
        return dataclasses.replace(profile, **changes)

    def recheck(self, recorded: Profile) -> Profile:
        """The profile a session made earlier with ``recorded`` gets now, when it starts again
        (resume, rewind, fork, take-over): the operator's current profile of that name with the
        tenant's own choices (what differs from the profile's defaults) checked again against
        today's ceilings, runtimes and network grant. A session's snapshot must not carry it past
        settings the operator has since narrowed. Raises as :meth:`for_tenant` (the profile may
        be gone: UnknownProfileError)."""
        current = self.profile(recorded.name)
        chosen, defaults = recorded.to_dict(), current.to_dict()
        request: dict[str, Any] = {
            key: chosen[key] for key in TENANT_SETTINGS - {"network"} if chosen[key] != defaults[key]
        }
        if recorded.network != current.network:
            if recorded.network is None:
                request["network"] = "none"
            else:
                narrowed = recorded.network.to_config()
                request["network"] = {key: narrowed[key] for key in ("allow", "ports", "rate_per_minute")}
        return self.for_tenant(recorded.name, request)

    def _network_for(self, profile: Profile, request: Any) -> EgressPolicy | None:
        """A tenant's network: "none", or a narrowing of what the profile (or else the operator's
        ``--egress-policy``) grants. The tenant can never widen it."""
        if request in (None, "none"):
            return None
        grantor = profile.network or self.egress_policy
        if grantor is None:
            raise EgressNotPermitted(
                "this gateway grants no network: the operator can enable an allowlist with --egress-policy FILE "
                "or a profile's network setting"
            )
        try:
            return EgressPolicy.from_config(grantor.narrowed(request))
        except EgressNotPermitted:
            raise
        except ConfigError as err:
            raise BadNetworkError(str(err)) from None
