"""The cluster on top of one host: where a request is served, decided once per request.

A gateway that is one of several asks this router, before a request's verb runs, where the
session or kernel its path names lives (:meth:`ClusterRouter.route`):

- **here**: this host holds it, or nobody does, or another tenant does (answered here, so another
  tenant's id reads exactly like a missing one): ``None``, and the handler's own verb runs;
- **there**: another up host holds it: :class:`Forward`, which passes the request (its body read
  under this host's limits) to the owner and relays the answer as it comes (forward.py);
- **lost**: its host is down and no gateway holds it: :class:`AnswerLost`, which answers from the
  session's record (its model and delete, as on the host that held it; anything else a 410),
  unless the session was paused, in which case this host takes it over (takeover.py) and serves it.

The single-host core (gateway/base.py) names what it asks of this module by two small protocols
(``Router`` and ``Route``) and imports nothing of gateway/cluster: server.py gives the router to the
handlers. New sessions are placed here too (:meth:`ClusterRouter.placed_elsewhere`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sandkernel.errors import KernelNotFoundError
from sandkernel.gateway.cluster.forward import ClusterLink, Forwarded, ForwardedChannels, forward_http
from sandkernel.gateway.cluster.placement import placed_elsewhere, up_hosts
from sandkernel.gateway.cluster.takeover import take_over_paused
from sandkernel.gateway.managed import LostSession

if TYPE_CHECKING:
    from tornado import websocket
    from tornado.httputil import HTTPServerRequest

    from sandkernel.gateway.base import BaseHandler
    from sandkernel.gateway.cluster.catalog import HostInfo

log = logging.getLogger(__name__)


class Forward:
    """A request another host answers: passed there once its body is in."""

    def __init__(self, host: HostInfo) -> None:
        self.host = host

    async def serve(self, handler: BaseHandler) -> None:
        await forward_http(handler, self.host)


class AnswerLost:
    """A request for a session lost with its host: the session's own GET gives its model (state
    ``lost``, why) and its DELETE clears it, as on the host that held it; anything else is the
    410 that says to delete it."""

    def __init__(self, link: ClusterLink, lost: LostSession) -> None:
        self.link = link
        self.lost = lost

    async def serve(self, handler: BaseHandler) -> None:
        lost = self.lost
        if handler.serves_session_model and handler.request.method == "GET":
            handler.write_json(lost.session_model())
            return
        if handler.serves_session_model and handler.request.method == "DELETE":
            await self.link.forget_lost(handler.tenant, lost.id)
            handler.set_status(204)
            handler.finish()
            return
        raise lost.error()


class ClusterRouter:
    """Decides, once per request, whether this host serves it (see the module docstring)."""

    def __init__(self, link: ClusterLink) -> None:
        self.link = link

    async def route(
        self, handler: BaseHandler, session_id: str | None, kernel_id: str | None
    ) -> Forward | AnswerLost | None:
        registry, tenant = handler.registry, handler.tenant
        if session_id is not None:
            if registry.holds(tenant, session_id):
                return None
        elif kernel_id is not None:
            try:
                registry.by_kernel(tenant, kernel_id)
                return None
            except KernelNotFoundError:
                pass
        link = self.link
        host = await link.owner_elsewhere(tenant, session_id=session_id, kernel_id=kernel_id)
        if host is None and session_id is not None and (pending := link.takeovers.get(session_id)) is not None:
            # This host's take-over of it moved its record here while this request asked: the
            # session is served here once the take-over holds it (a 404 in between, before).
            await asyncio.shield(pending)
            return None
        if host is not None and host.status == "down" and session_id is not None:
            lost = await link.lost_with_its_host(tenant, session_id)
            if lost is not None:  # no gateway holds it: answered here, from its record
                return AnswerLost(link, LostSession(lost, lost.lost_reason or f"its host {host.host_id} is down"))
            if await take_over_paused(registry, link, tenant, session_id):
                return None  # paused here now (its snapshot is in the dir the hosts share): served here
        return Forward(host) if host is not None else None

    async def placed_elsewhere(self, handler: BaseHandler, profile: str | None, limits: Mapping[str, Any]) -> bool:
        """Place a new session; True when another host took it and its answer was relayed."""
        return await placed_elsewhere(handler, profile, limits)

    async def forward(self, handler: BaseHandler, host: HostInfo) -> None:
        """Pass the handler's request to ``host`` (MCP's modern requests, which name their session
        in the body rather than the path, are routed by their door: gateway/mcp/http.py)."""
        await forward_http(handler, host)

    async def runtimes(self) -> set[str] | None:
        """The runtimes some up host of the cluster runs (as each registered them); None when the
        catalog cannot be read within the catalog timeout (logged): the kernelspecs a tenant is
        offered (gateway/kernels_api.py)."""
        hosts = await up_hosts(self.link)
        if hosts is None:
            log.warning("kernelspecs: the cluster's hosts could not be read, listing the profile's")
            return None
        return {runtime for host in hosts for runtime in host.runtimes}

    # -- the kernel websocket (gateway/channels.py: a websocket handler, routed at its handshake) --

    def forwarded_from(self, request: HTTPServerRequest) -> Forwarded | None:
        """The verified forwarding of a request another gateway sent here (401 on a bad one)."""
        return self.link.forwarded_from(request)

    async def websocket_owner(self, tenant: str, kernel_id: str) -> HostInfo | None:
        """The other host that holds the tenant's kernel, if another one does."""
        return await self.link.owner_elsewhere(tenant, kernel_id=kernel_id)

    async def relay_websocket(
        self, handler: websocket.WebSocketHandler, host: HostInfo
    ) -> ForwardedChannels | tuple[int, bytes]:
        """Open the websocket to the owner (its refusal, status and body, to pass on)."""
        return await ForwardedChannels.connect(handler, self.link, host)
