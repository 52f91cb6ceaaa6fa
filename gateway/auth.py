"""Token authentication and tenants.

Every request carries a token (``Authorization: token T`` or ``Bearer T``). ``?token=T`` in the
URL is refused unless the operator allows it (``--allow-token-in-url``, for browser websockets,
which cannot set headers): URLs end up in logs, proxies and browser history. Each token names a tenant; every
session and kernel belongs to the tenant whose token created it. Tokens are compared with
``hmac.compare_digest`` against every known token, so timing reveals nothing. Tokens live only
in the gateway process: they are never placed in a kernel's environment.
"""

from __future__ import annotations

import collections
import hmac
import json
import os
import secrets
import stat
import time
from pathlib import Path

from sandkernel.errors import ConfigError

DEFAULT_TENANT = "default"
# Failed authentications one client address may make per window before it is refused (429)
# without its tokens being checked at all: token guessing becomes hopeless, and requests that
# carry a valid token are never held back, so a tenant behind the same address is unaffected.
MAX_AUTH_FAILURES = 30
AUTH_FAILURE_WINDOW = 60.0  # seconds
# Addresses remembered at once (the oldest is forgotten first): the limiter's memory is bounded.
MAX_TRACKED_ADDRESSES = 10_000
MIN_TOKEN_CHARS = 16  # a tokens file's tokens and the metrics token


def new_token() -> str:
    """A fresh 256-bit gateway token. Hex, not ``token_urlsafe``: one urlsafe token in 64 starts
    with ``-``, which a command line such as ``--token $TOKEN`` then reads as an option."""
    return secrets.token_hex(32)


class FailedAuthLimiter:
    """Counts failed authentications per client address over a sliding window."""

    def __init__(self, max_failures: int = MAX_AUTH_FAILURES, window: float = AUTH_FAILURE_WINDOW) -> None:
        self.max_failures = max_failures
        self.window = window
        self._failures: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it is not held back."""
        seen = self._failures.get(address)
        if seen is None:
            return None
        now = time.monotonic()
        while seen and now - seen[0] > self.window:
            seen.popleft()
        if len(seen) < self.max_failures:
            return None
        return max(self.window - (now - seen[0]), 0.0)

    def record_failure(self, address: str) -> None:
        seen = self._failures.pop(address, None) or collections.deque(maxlen=self.max_failures)
        seen.append(time.monotonic())
        self._failures[address] = seen  # most recent last
        while len(self._failures) > MAX_TRACKED_ADDRESSES:
            self._failures.popitem(last=False)


class TokenAuth:
    """Maps bearer tokens to tenant names."""

    def __init__(self, tokens: dict[str, str], allow_query_token: bool = False) -> None:
        if not tokens:
            raise ConfigError("at least one token is required (or pass --no-auth explicitly)")
        self._tokens = [(token.encode(), tenant) for token, tenant in tokens.items()]
        self.allow_query_token = allow_query_token
        self.failures = FailedAuthLimiter()
        self._metrics_token: bytes | None = None

    @property
    def serves_metrics(self) -> bool:
        """Whether the operator set a metrics token (without one, /metrics is served to nobody)."""
        return self._metrics_token is not None

    def set_metrics_token(self, token: str | None) -> None:
        """The operator's token for /metrics (Prometheus sends it as a bearer token). It must
        not be a tenant's: the metrics count every tenant's sessions, snapshots and executions."""
        if token is None:
            self._metrics_token = None
            return
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"the metrics token must have {MIN_TOKEN_CHARS}+ characters")
        if self.tenant_for(f"token {token}") is not None:
            raise ConfigError("the metrics token must differ from every tenant's token")
        self._metrics_token = token.encode()

    def is_metrics_token(self, authorization: str | None) -> bool:
        """Whether the request's Authorization header carries the operator's metrics token."""
        supplied = _presented(authorization)
        known = self._metrics_token
        return known is not None and supplied is not None and hmac.compare_digest(supplied.encode(), known)

    @classmethod
    def from_sources(
        cls, token: str | None = None, tokens_file: str | os.PathLike[str] | None = None
    ) -> tuple[TokenAuth, str | None]:
        """Build from a tokens file (JSON ``{"tenant": "token"}``), else ``token``, else a freshly
        generated token (``$SANDKERNEL_TOKEN`` is read with the other settings, in settings.py).
        Returns the auth and the single token to print (None when a tokens file was used)."""
        if tokens_file:
            _refuse_shared_secret_file(tokens_file)
            try:
                tenants = json.loads(Path(tokens_file).read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"cannot read tokens file {tokens_file}: {err}") from err
            if not isinstance(tenants, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and len(v) >= MIN_TOKEN_CHARS for k, v in tenants.items()
            ):
                raise ConfigError(
                    f'tokens file must be a JSON object {{"tenant": "token"}} with tokens of {MIN_TOKEN_CHARS}+ chars'
                )
            return cls({token: tenant for tenant, token in tenants.items()}), None
        chosen = token or new_token()
        return cls({chosen: DEFAULT_TENANT}), chosen

    def tenant_for(self, authorization: str | None, query_token: str | None = None) -> str | None:
        """The tenant owning the presented token, or None."""
        supplied = _presented(authorization) or query_token
        if not supplied:
            return None
        supplied_bytes = supplied.encode()
        found = None
        for known, tenant in self._tokens:
            if hmac.compare_digest(supplied_bytes, known):
                found = tenant
        return found


def _presented(authorization: str | None) -> str | None:
    """The token of an ``Authorization: token T`` (or ``Bearer T``) header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() in ("token", "bearer") and value.strip():
        return value.strip()
    return None


def _refuse_shared_secret_file(path: str | os.PathLike[str]) -> None:
    """A tokens file readable by the group or by others is refused: any local user (or a
    sandbox that could ever see the host's files) would hold every tenant's token."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as err:
        raise ConfigError(f"cannot read tokens file {path}: {err}") from err
    if mode & 0o077:
        raise ConfigError(
            f"tokens file {path} is readable or writable by group or others (mode {mode:04o}); run: chmod 600 {path}"
        )
