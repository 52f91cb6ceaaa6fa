"""Token authentication and tenants.

Every request carries a token (``Authorization: token T`` or ``Bearer T``). ``?token=T`` in the
URL is refused unless the operator allows it (``--allow-token-in-url``, for browser websockets,
which cannot set headers): URLs end up in logs, proxies and browser history. Each token names a tenant; every
session and kernel belongs to the tenant whose token created it. Tokens are compared with
``hmac.compare_digest`` against every known token, so timing reveals nothing. Tokens live only
in the gateway process: they are never placed in a kernel's environment.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from pathlib import Path

from sandkernel.errors import ConfigError

DEFAULT_TENANT = "default"


class TokenAuth:
    """Maps bearer tokens to tenant names."""

    def __init__(self, tokens: dict[str, str], allow_query_token: bool = False) -> None:
        if not tokens:
            raise ConfigError("at least one token is required (or pass --no-auth explicitly)")
        self._tokens = [(token.encode(), tenant) for token, tenant in tokens.items()]
        self.allow_query_token = allow_query_token

    @classmethod
    def from_sources(cls, token: str | None = None, tokens_file: str | None = None) -> tuple[TokenAuth, str | None]:
        """Build from ``--tokens-file`` (JSON ``{"tenant": "token"}``), ``--token``, the
        ``SANDKERNEL_TOKEN`` environment variable, or a freshly generated token, in that order.
        Returns the auth and the single token to print (None when a tokens file was used)."""
        if tokens_file:
            try:
                tenants = json.loads(Path(tokens_file).read_text())
            except (OSError, ValueError) as err:
                raise ConfigError(f"cannot read tokens file {tokens_file}: {err}") from err
            if not isinstance(tenants, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and len(v) >= 16 for k, v in tenants.items()
            ):
                raise ConfigError('tokens file must be a JSON object {"tenant": "token"} with tokens of 16+ chars')
            return cls({token: tenant for tenant, token in tenants.items()}), None
        chosen = token or os.environ.get("SANDKERNEL_TOKEN") or secrets.token_urlsafe(32)
        return cls({chosen: DEFAULT_TENANT}), chosen

    def tenant_for(self, authorization: str | None, query_token: str | None = None) -> str | None:
        """The tenant owning the presented token, or None."""
        supplied = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() in ("token", "bearer") and value.strip():
                supplied = value.strip()
        if supplied is None:
            supplied = query_token
        if not supplied:
            return None
        supplied_bytes = supplied.encode()
        found = None
        for known, tenant in self._tokens:
            if hmac.compare_digest(supplied_bytes, known):
                found = tenant
        return found
