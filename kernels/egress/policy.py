"""A session's network policy: none (the default), or an allowlist enforced outside the sandbox.

The sandbox never gets a route out. With an allowlist, the kernel reaches one place: the
session's egress proxy on the host (see egress_proxy.py), which checks every request against
this policy: the *name* first (before any DNS lookup), then the port, the rate, and finally the
addresses the name resolved to (loopback, link-local, private, metadata and other non-global
ranges are refused unless the policy lists them). No policy can grant unrestricted network:
``*`` and whole-TLD wildcards such as ``*.com`` are refused.

Config (JSON, as a profile's ``network`` setting)::

    {"allow": ["pypi.org", "*.pythonhosted.org"],      # exact names, or *.suffix
     "ports": [443],                                     # default [80, 443]
     "rate_per_minute": {"pypi.org": 600},               # per host pattern; default unlimited
     "allow_addresses": ["203.0.113.0/24"],              # non-global ranges allowed explicitly
     "resolve": {"api.internal": "10.0.0.5"},            # pinned answers (like curl --resolve)
     "inject_headers": {"api.example.com": {"Authorization": "Bearer ..."}},  # http:// only
     "ca_bundle": "/etc/ssl/certs/ca-certificates.crt"}  # host file mounted for TLS clients
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from sandkernel.errors import ConfigError, SettingNotPermittedError

DEFAULT_PORTS = (80, 443)
# Reachable only where the policy lists them: never global, or the cloud metadata service.
METADATA = (ipaddress.ip_network("169.254.169.254/32"), ipaddress.ip_network("fd00:ec2::254/128"))
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
POLICY_KEYS = {"allow", "ports", "rate_per_minute", "allow_addresses", "resolve", "inject_headers", "ca_bundle"}


class EgressNotPermitted(SettingNotPermittedError):
    """A session asked for more network than the operator's policy grants."""

    code = "egress_not_permitted"


class BadNetworkError(ConfigError):
    """A session's network setting is malformed (not a narrowing the policy can read)."""

    code = "bad_network"


def _check_name(pattern: Any) -> str:
    """A lowercase host name or ``*.suffix`` with at least two labels after the star."""
    if not isinstance(pattern, str):
        raise ConfigError(f"network allow entries must be host names, not {pattern!r}")
    name = pattern.strip().lower().rstrip(".")
    bare = name[2:] if name.startswith("*.") else name
    if name in ("*", "") or "*" in bare:
        raise ConfigError(f"{pattern!r} would allow any host; list names or '*.example.com' suffixes")
    labels = bare.split(".")
    if not all(_LABEL.match(label) for label in labels):
        raise ConfigError(f"{pattern!r} is not a host name")
    if name.startswith("*.") and len(labels) < 2:
        raise ConfigError(f"{pattern!r} covers a whole top-level domain; name the domain, e.g. '*.example.com'")
    return name


def name_matches(pattern: str, host: str) -> bool:
    if pattern.startswith("*."):
        return host.endswith(pattern[1:])
    return host == pattern


def covers(ceiling: str, pattern: str) -> bool:
    """Whether every host ``pattern`` matches is also matched by ``ceiling``."""
    if ceiling == pattern:
        return True
    if not ceiling.startswith("*."):
        return False
    bare = pattern[2:] if pattern.startswith("*.") else pattern
    return bare.endswith(ceiling[1:])


@dataclasses.dataclass(frozen=True)
class EgressPolicy:
    allow: tuple[str, ...]
    ports: tuple[int, ...] = DEFAULT_PORTS
    rate_per_minute: Mapping[str, int] = dataclasses.field(default_factory=dict)
    allow_addresses: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    resolve: Mapping[str, str] = dataclasses.field(default_factory=dict)
    inject_headers: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    ca_bundle: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> EgressPolicy | None:
        """Validate a ``network`` setting: "none"/None, or an allowlist mapping. Errors say what to fix."""
        if config in (None, "none"):
            return None
        if not isinstance(config, Mapping):
            raise ConfigError('network must be "none" or {"allow": ["host", "*.example.com", ...], ...}')
        unknown = set(config) - POLICY_KEYS - {"mode"}
        if unknown:
            raise ConfigError(f"unknown network settings {sorted(unknown)}; known: {sorted(POLICY_KEYS)}")
        if config.get("mode", "allowlist") != "allowlist":
            raise ConfigError('network mode must be "allowlist" (or the whole setting "none")')
        allow = config.get("allow")
        if not isinstance(allow, list) or not allow:
            raise ConfigError("network allow must be a non-empty list of host names")
        ports = config.get("ports", list(DEFAULT_PORTS))
        if (
            not isinstance(ports, list)
            or not ports
            or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports)
        ):
            raise ConfigError("network ports must be a non-empty list of port numbers")
        rates = config.get("rate_per_minute") or {}
        if not isinstance(rates, Mapping) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 100_000 for v in rates.values()
        ):
            raise ConfigError("network rate_per_minute must map host patterns to 1..100000 requests per minute")
        try:
            networks = tuple(ipaddress.ip_network(n, strict=False) for n in config.get("allow_addresses") or [])
            resolve = {_check_name(k): str(ipaddress.ip_address(v)) for k, v in (config.get("resolve") or {}).items()}
        except (ValueError, TypeError) as err:
            raise ConfigError(f"network allow_addresses/resolve: {err}") from None
        if any(n.prefixlen == 0 for n in networks):
            raise ConfigError("network allow_addresses may not contain 0.0.0.0/0 or ::/0")
        headers = config.get("inject_headers") or {}
        if not isinstance(headers, Mapping) or not all(
            isinstance(h, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in h.items())
            for h in headers.values()
        ):
            raise ConfigError("network inject_headers must map host names to {header: value}")
        bundle = config.get("ca_bundle")
        if bundle is not None and (not isinstance(bundle, str) or not os.path.isfile(bundle)):
            raise ConfigError(f"network ca_bundle must be an existing host file, not {bundle!r}")
        return cls(
            allow=tuple(_check_name(p) for p in allow),
            ports=tuple(ports),
            rate_per_minute={_check_name(k): v for k, v in rates.items()},
            allow_addresses=networks,
            resolve=resolve,
            inject_headers={_check_name(k): dict(v) for k, v in headers.items()},
            ca_bundle=bundle,
        )

    def to_dict(self) -> dict[str, Any]:
        """For notebook metadata and API replies: injected header values are never shown."""
        return {
            "allow": list(self.allow),
            "ports": list(self.ports),
            "rate_per_minute": dict(self.rate_per_minute),
            "allow_addresses": [str(n) for n in self.allow_addresses],
            "resolve": dict(self.resolve),
            "inject_headers": {host: sorted(h) for host, h in self.inject_headers.items()},
            "ca_bundle": self.ca_bundle,
        }

    def narrowed(self, request: Any) -> dict[str, Any]:
        """The policy a session gets when it asks for ``request`` under this operator policy.

        A session may only narrow: ``"operator"`` takes this policy whole; a mapping may name
        ``allow`` (each covered by ours), ``ports`` (a subset) and ``rate_per_minute`` (stricter).
        Addresses, pinned names, injected headers and the CA bundle stay the operator's to set:
        a tenant that could set them could aim the proxy at the operator's private network."""
        base = self.to_config()
        if request == "operator":
            return base
        if not isinstance(request, Mapping):
            raise ConfigError('network must be "none", "operator", or {"allow": [...], "ports": [...]}')
        operator_only = set(request) - {"allow", "ports", "rate_per_minute", "mode"}
        if operator_only:
            raise EgressNotPermitted(f"network settings {sorted(operator_only)} can only be set by the operator")
        allow = [_check_name(p) for p in request.get("allow") or []]
        outside = [p for p in allow if not any(covers(c, p) for c in self.allow)]
        if outside or not allow:
            raise EgressNotPermitted(
                f"network allow {outside or '[]'} is beyond what this gateway permits: {', '.join(self.allow)}"
            )
        ports = request.get("ports", list(self.ports))
        if not isinstance(ports, list) or not set(ports) <= set(self.ports):
            raise EgressNotPermitted(f"network ports {ports} are beyond what this gateway permits: {list(self.ports)}")
        rates = dict(base["rate_per_minute"])
        for pattern, limit in (request.get("rate_per_minute") or {}).items():
            rates[pattern] = min(limit, rates.get(pattern, limit)) if isinstance(limit, int) else limit
        return dict(base, allow=allow, ports=ports, rate_per_minute=rates)

    def to_config(self) -> dict[str, Any]:
        """The mapping :meth:`from_config` accepts (header values included: host side only)."""
        return dict(self.to_dict(), inject_headers={h: dict(v) for h, v in self.inject_headers.items()})

    # -- checks made by the proxy --------------------------------------------------------------

    def name_refusal(self, host: str, port: int) -> str | None:
        """Why ``host:port`` is refused by name or port (None: allowed so far). No DNS involved."""
        host = host.lower().rstrip(".")
        if not any(name_matches(p, host) for p in self.allow):
            return f"{host} is not in the allowlist"
        if port not in self.ports:
            return f"port {port} is not allowed (allowed: {', '.join(map(str, self.ports))})"
        return None

    def address_refusal(self, address: str) -> str | None:
        ip = ipaddress.ip_address(address)
        if any(ip in n for n in self.allow_addresses):
            return None
        if any(ip in n for n in METADATA):
            return f"{address} is the cloud metadata service"
        if not ip.is_global:
            return f"{address}, which is not a public address (loopback, link-local, private or reserved)"
        return None

    def headers_for(self, host: str) -> Mapping[str, str]:
        return next((h for p, h in self.inject_headers.items() if name_matches(p, host.lower())), {})


class RateLimiter:
    """Requests per minute per host pattern, over a sliding window."""

    def __init__(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self._seen: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    def refusal(self, host: str) -> str | None:
        for pattern, limit in self.policy.rate_per_minute.items():
            if name_matches(pattern, host.lower()):
                now = time.monotonic()
                seen = self._seen[pattern]
                while seen and now - seen[0] > 60:
                    seen.popleft()
                if len(seen) >= limit:
                    return f"rate limit of {limit} requests per minute for {pattern} reached"
                seen.append(now)
        return None
