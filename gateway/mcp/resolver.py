"""Which sandbox session an MCP tool call acts on: the seam between the MCP tools and a transport.

The tools (``tools.py``) know nothing of tokens, tenants or transports. Each call asks the
transport for the caller's :class:`SessionResolver` and acts on the session it hands back:

    from sandkernel.gateway.mcp.tools import build_mcp_server
    server = build_mcp_server(resolver_for, budget)   # -> mcp.server.mcpserver.MCPServer
    resolver_for: ResolverFor = Callable[[ServerRequestContext], SessionResolver]
    budget: OutputBudget                               # the gateway's settings.budget

``server`` is the SDK's high-level server; a transport runs it with the SDK's own API: stdio with
``server.run_stdio_async()``; streamable HTTP with ``app = server.streamable_http_app(
streamable_http_path="/mcp", ...)`` (a Starlette ASGI app) served while
``server.session_manager.run()`` is entered (its task group). Build one server per gateway.

``resolver_for`` is called once per tool call or resource read, with the SDK's request context
(``mcp.server.context.ServerRequestContext``, what ``Context.request_context`` of
``mcp.server.mcpserver`` holds). What a transport reads from it:

- ``ctx.request``: the HTTP request of this message on the streamable HTTP transports (a Starlette
  ``Request``: ``.headers``, ``.scope``; put what you resolved, such as the tenant, into
  ``scope`` before handing the request to the SDK's ASGI app and read it back here); ``None`` on
  stdio.
- ``ctx.session`` / ``ctx.protocol_version``: the MCP connection and protocol generation (a
  legacy client's ``Mcp-Session-Id`` is the ``mcp-session-id`` header of ``ctx.request``).

It must answer quickly (no I/O: it runs for every call) and may raise a
:class:`~sandkernel.errors.SandkernelError` (e.g. ``KernelNotFoundError``) whose message the
caller then sees as the tool's error. The stdio door (``sandkernel mcp``) has one caller and one
resolver, so its ``resolver_for`` ignores the context (``lambda ctx: resolver``).

:class:`TenantResolver` is the resolver over the gateway's :class:`SessionRegistry` for one
tenant: the stdio door uses it as is; the HTTP door can too (one per tenant, or one per legacy MCP
session, whose default session it then closes when that MCP session ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mcp.server.context import ServerRequestContext

from sandkernel import doors
from sandkernel.errors import ConfigError, KernelNotFoundError, SandboxLostError
from sandkernel.gateway.managed import ManagedSession
from sandkernel.gateway.registry import SessionRegistry

log = logging.getLogger(__name__)


class SessionResolver(Protocol):
    """Which sandbox session an MCP tool call acts on, for whoever is calling.

    Every method sees only the caller's own sessions: an id of another tenant's session raises
    exactly what an unknown id raises (``KernelNotFoundError``), so an id leaks nothing."""

    async def session_for(self, session_id: str | None) -> ManagedSession:
        """``None``: the caller's default session, started on first use (and again after it was
        closed); else the caller's session with that id (``KernelNotFoundError`` for an unknown or
        foreign id, ``SandboxLostError`` for a lost one)."""
        ...

    async def create(self, options: Mapping[str, Any]) -> ManagedSession:
        """Start another session for the caller. ``options`` (already type-checked by the tool):
        ``profile`` (str), ``limits`` (dict), ``metadata`` (dict); ConfigError-family errors for
        what the operator's catalog refuses, ``TooManySessionsError`` at the limit."""
        ...

    async def close(self, session_id: str) -> None:
        """End one of the caller's sessions (its container removed; the transcript is kept)."""
        ...

    def sessions(self) -> list[ManagedSession]:
        """The caller's live sessions."""
        ...


ResolverFor = Callable[[ServerRequestContext[Any, Any]], SessionResolver]
"""What a transport gives :func:`sandkernel.gateway.mcp.tools.build_mcp_server`: the resolver of
the caller of one request (see the module docstring)."""


class TenantResolver:
    """A :class:`SessionResolver` over a gateway registry for one tenant.

    The default session is started lazily, once even when first calls race (a lock), with the
    ``defaults`` options (``profile``/``limits``/``metadata``). It is remembered by id: if it was
    closed (by the close tool, the idle culler, a person) the next default call starts a fresh
    one, and its id in the tool's result says it is a new one. :meth:`close_all` ends what this
    resolver started; a transport calls it when its caller goes away."""

    def __init__(
        self,
        registry: SessionRegistry,
        tenant: str,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.registry = registry
        self.tenant = tenant
        self.defaults = dict(defaults or {})
        self.default_id: str | None = None
        self.started: set[str] = set()  # ids this resolver created (close_all ends these)
        self._lock = asyncio.Lock()

    async def session_for(self, session_id: str | None) -> ManagedSession:
        if session_id is not None:
            return await self.registry.live(self.tenant, session_id, doors.MCP)
        async with self._lock:
            if self.default_id is not None:
                with contextlib.suppress(KernelNotFoundError, SandboxLostError):
                    return await self.registry.live(self.tenant, self.default_id, doors.MCP)
                log.info("the default MCP session is gone; starting another", extra={"session": self.default_id})
            managed = await self.create(self.defaults)
            self.default_id = managed.id
            return managed

    async def create(self, options: Mapping[str, Any]) -> ManagedSession:
        profile = options.get("profile")
        limits = options.get("limits") or {}
        metadata = {"door": "mcp", **(options.get("metadata") or {})}
        if profile is not None and not isinstance(profile, str):
            raise ConfigError("profile must be a profile name such as 'default', 'small' or 'large'")
        if not isinstance(limits, Mapping) or not isinstance(metadata, Mapping):
            raise ConfigError("limits and metadata must be objects")
        # origin "session_api": an agent's session, which JupyterLab may watch but not shut down
        managed = await self.registry.create(self.tenant, profile, limits, metadata, origin="session_api")
        self.started.add(managed.id)
        return managed

    async def close(self, session_id: str) -> None:
        await self.registry.delete(self.tenant, session_id)
        self.started.discard(session_id)
        if session_id == self.default_id:
            self.default_id = None

    def sessions(self) -> list[ManagedSession]:
        return self.registry.list(self.tenant)

    async def close_all(self) -> None:
        """End every session this resolver started that is still there, live or paused (the caller
        went away)."""
        live = {m.id for m in self.registry.list(self.tenant)}
        live |= {p.id for p in self.registry.paused_sessions() if p.tenant == self.tenant}
        doomed = [sid for sid in self.started if sid in live]
        results = await asyncio.gather(
            *(self.registry.delete(self.tenant, sid) for sid in doomed), return_exceptions=True
        )
        for sid, outcome in zip(doomed, results, strict=True):
            if isinstance(outcome, BaseException):
                log.warning("closing an MCP session failed: %s", outcome, extra={"session": sid})
        self.started.clear()
        self.default_id = None
