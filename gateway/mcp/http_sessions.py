"""Whose sandbox sessions an MCP call over ``/mcp`` may touch, and when the implicit ones end.

The caller is the tenant of the request's gateway token (the handler authenticated it before the
SDK saw the request, and put it in the ASGI scope: :func:`scope_user`). Every resolver handed to
a tool is scoped to that tenant, so another tenant's ``session_id`` answers exactly like an
unknown one (:class:`~sandkernel.gateway.mcp.resolver.TenantResolver` over the registry).

What a call *without* ``session_id`` acts on depends on the protocol generation:

- **legacy** (handshake versions, ``Mcp-Session-Id``): the MCP session has a default sandbox
  session, started on first use and deleted when the MCP session ends: the client's DELETE, or
  :meth:`HttpSessions.sweep` finding it idle for ``idle`` seconds (no request in flight, none
  since). The gateway, not the SDK, keeps that clock (the SDK's own idle expiry is off): it knows
  every request, and ends an idle MCP session in the SDK with the same DELETE a client sends, so
  one clock decides both ends.
- **modern** (2026-07-28: a self-contained POST per request, nothing to hang state on): each such
  call starts a new session and its result names its id, for the model to pass next time;
  sessions a client abandons are the gateway's idle culling's to remove.

Sessions made with the ``create_session`` tool are explicit handles in either generation: they
outlive the MCP session that made them, until ``close_session`` or the idle culler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from sandkernel.errors import SandkernelError
from sandkernel.gateway.managed import ManagedSession
from sandkernel.gateway.mcp.resolver import SessionResolver, TenantResolver
from sandkernel.gateway.registry import SessionRegistry

log = logging.getLogger(__name__)

MCP_SESSION_HEADER = "mcp-session-id"
# Where a stateless call records the session it started (in its request's ASGI scope), for
# :func:`note_started_sessions` to tell the model.
STARTED_KEY = "sandkernel.started_sessions"


def scope_user(tenant: str) -> AuthenticatedUser:
    """What the handler puts in the ASGI scope's ``user``: the SDK's session manager only serves a
    legacy MCP session to the credential that opened it (another tenant's ``Mcp-Session-Id``
    gets the SDK's own 404, as an unknown one does), and the resolvers read the tenant back from
    it. No secret is in it: the token stays in the handler."""
    return AuthenticatedUser(AccessToken(token="", client_id=tenant, scopes=[]))


def tenant_of(scope: dict[str, Any]) -> str | None:
    """The tenant :func:`scope_user` put in ``scope``, or None for a request that did not come
    through the gateway's handler."""
    user = scope.get("user")
    return user.access_token.client_id if isinstance(user, AuthenticatedUser) else None


@dataclasses.dataclass
class LegacySession:
    """One legacy MCP session: its tenant, its resolver (the default sandbox session) and its
    activity clock."""

    tenant: str
    resolver: TenantResolver
    in_flight: int = 0
    last_seen: float = dataclasses.field(default_factory=time.monotonic)


class StatelessResolver(TenantResolver):
    """A modern (stateless) call's resolver: without ``session_id`` it starts a new session
    (nothing ties this call to an earlier one) and records it in the request's scope, so the
    result can name it (:func:`note_started_sessions`)."""

    def __init__(self, registry: SessionRegistry, tenant: str, scope: dict[str, Any]) -> None:
        super().__init__(registry, tenant)
        self.scope = scope

    async def session_for(self, session_id: str | None) -> ManagedSession:
        managed = await super().session_for(session_id)
        if session_id is None:
            self.scope.setdefault(STARTED_KEY, []).append(managed.id)
        return managed


def started_note(session_id: str) -> str:
    """What the model reads after a call without ``session_id`` started a session for it."""
    return (
        f"[sandkernel: this call started a new session, {session_id}, because this MCP client "
        f'keeps no connection state (protocol 2026-07-28). Pass session_id="{session_id}" to every '
        "later call to keep its variables and files; without it each call starts another session.]"
    )


async def note_started_sessions(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Server middleware (the SDK's ``server.middleware``): a tool result whose call started a
    session without being asked gets a line naming it (:func:`started_note`)."""
    result = await call_next(ctx)
    request = ctx.request
    started = request.scope.get(STARTED_KEY) if ctx.method == "tools/call" and request is not None else None
    if started and isinstance(result, dict) and isinstance(result.get("content"), list):
        notes = [{"type": "text", "text": started_note(sid)} for sid in started]
        result = {**result, "content": [*result["content"], *notes]}
    return result


class HttpSessions:
    """The ``/mcp`` door's resolvers and legacy MCP sessions; the handler reports each request's
    start and end, and the MCP sessions it sees open and close."""

    def __init__(self, registry: SessionRegistry, idle: float) -> None:
        """``idle``: seconds a legacy MCP session may go without a request before it is ended
        (with its default sandbox session)."""
        self.registry = registry
        self.idle = idle
        self._legacy: dict[str, LegacySession] = {}
        # Ends an MCP session in the SDK (http.py sends it a DELETE); set once the SDK runs.
        self.terminate: Callable[[str, str], Awaitable[None]] | None = None

    def resolver_for(self, ctx: ServerRequestContext[Any, Any]) -> SessionResolver:
        """The resolver of one tool call's caller (tools.py calls it; see resolver.py)."""
        request = ctx.request
        tenant = tenant_of(request.scope) if request is not None else None
        if tenant is None:
            raise SandkernelError("this MCP request did not come through the gateway's /mcp door")
        mcp_session = request.headers.get(MCP_SESSION_HEADER)
        # A modern request's Mcp-Session-Id means nothing (the SDK ignores it too): it must not
        # pick a legacy session's default, even the same tenant's.
        if mcp_session is not None and ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS:
            legacy = self._legacy.get(mcp_session)
            if legacy is not None and legacy.tenant == tenant:
                return legacy.resolver
            log.warning("a legacy MCP request of an MCP session the gateway does not know: no default session")
        return StatelessResolver(self.registry, tenant, request.scope)

    # -- what the handler reports ----------------------------------------------------------

    def opened(self, tenant: str, mcp_session: str) -> None:
        """The SDK answered an ``initialize`` with a new ``Mcp-Session-Id`` for ``tenant``."""
        self._legacy[mcp_session] = LegacySession(tenant, TenantResolver(self.registry, tenant))

    def _known(self, tenant: str, mcp_session: str | None) -> LegacySession | None:
        legacy = self._legacy.get(mcp_session) if mcp_session else None
        return legacy if legacy is not None and legacy.tenant == tenant else None

    def request_started(self, tenant: str, mcp_session: str | None) -> None:
        if (legacy := self._known(tenant, mcp_session)) is not None:
            legacy.in_flight += 1
            legacy.last_seen = time.monotonic()

    def request_ended(self, tenant: str, mcp_session: str | None) -> None:
        if (legacy := self._known(tenant, mcp_session)) is not None:
            legacy.in_flight -= 1
            legacy.last_seen = time.monotonic()

    async def closed(self, tenant: str, mcp_session: str) -> None:
        """The MCP session ended (the client's DELETE was answered, or :meth:`sweep` ended it):
        delete its default sandbox session, if it has one."""
        legacy = self._legacy.get(mcp_session)
        if legacy is None or legacy.tenant != tenant:
            return
        del self._legacy[mcp_session]
        default_id = legacy.resolver.default_id
        if default_id is None or self.registry.stopping:  # stopping: on_exit decides for every session
            return
        log.info("MCP session ended: deleting its default session", extra={"session": default_id, "tenant": tenant})
        try:
            await legacy.resolver.close(default_id)
        except SandkernelError as err:  # already gone (closed by the model, culled): nothing left
            log.info("the MCP session's default session was already gone: %s", err, extra={"session": default_id})

    async def sweep(self) -> list[str]:
        """End legacy MCP sessions idle for :attr:`idle` seconds (in the SDK too); their ids.
        http.py's sweeper calls this every ``cull_interval``."""
        now = time.monotonic()
        idle = [
            (sid, legacy.tenant)
            for sid, legacy in self._legacy.items()
            if legacy.in_flight <= 0 and now - legacy.last_seen > self.idle
        ]
        for sid, tenant in idle:
            log.info("MCP session idle for %.0fs: ending it", self.idle, extra={"tenant": tenant})
            if self.terminate is not None:
                await self.terminate(tenant, sid)
            await self.closed(tenant, sid)
        return [sid for sid, _ in idle]

    def legacy_sessions(self) -> dict[str, LegacySession]:
        """The legacy MCP sessions open now, by ``Mcp-Session-Id``."""
        return dict(self._legacy)

    def __len__(self) -> int:
        return len(self._legacy)
