"""Where a new session goes in a cluster: the one placement every door that creates uses.

Both ``POST /api/sessions`` and ``POST /api/kernels`` (a kernel is a session) start here, so a
create through any gateway lands on the host with most free room that runs its runtime, under
the same checks and errors wherever it was asked: the tenant's profile and limits are checked
on the gateway that was asked (every gateway of a cluster has the same profiles, so a bad one is
refused without a hop), the catalog picks the host (:meth:`ClusterCatalog.place`, which counts
the session on it at once), and a create placed on another host is forwarded there with
``X-Sandkernel-Place-Here``; that host creates it where it lands (the loop guard: a verified
forwarded request is never placed again). The tenant's limit is counted cluster-wide by the
registry of the host that creates (its reservation in PostgreSQL), whichever door asked.

When no host can take it, the 503 says why: no host is up, none of the up hosts runs the
runtime (naming what they run), or every one that does is full.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sandkernel.errors import ClusterUnavailableError, SandkernelError
from sandkernel.gateway.cluster.forward import CATALOG_TIMEOUT_SECONDS, forward_http

if TYPE_CHECKING:
    from sandkernel.gateway.base import BaseHandler
    from sandkernel.gateway.cluster.catalog import HostInfo
    from sandkernel.gateway.cluster.forward import ClusterLink


async def placed_elsewhere(handler: BaseHandler, profile: str | None, limits: Mapping[str, Any]) -> bool:
    """Cluster mode: place a new session of ``profile`` with ``limits`` and, when the catalog
    puts it on another host, pass the handler's request there (True: the request is answered,
    the owner's reply relayed). False: create it here (a single host, a create another gateway
    forwarded here, or this host was chosen).

    Raises the profile catalog's ConfigError (400) / SettingNotPermittedError (403) for a bad
    profile or limits, ClusterUnavailableError (503) when the catalog cannot be reached, when no
    host can take the session (saying why), or when the chosen host cannot be reached."""
    cluster = handler.cluster
    if cluster is None or handler.forwarded_from is not None:
        return False
    runtime = handler.registry.catalog.for_tenant(profile, limits).runtime.value
    host = await cluster.place(runtime)
    if host is None:
        raise ClusterUnavailableError(await _why_no_host(cluster, runtime))
    if host.host_id == cluster.host_id:
        return False
    await forward_http(handler, host, place_here=True)
    return True


async def up_hosts(cluster: ClusterLink) -> list[HostInfo] | None:
    """The hosts the catalog lists as up, or None when it cannot say within the catalog timeout
    (for answers that are a best effort: a 503's sentence, the kernelspecs offered)."""
    try:
        return await asyncio.wait_for(cluster.catalog.hosts(up_only=True), CATALOG_TIMEOUT_SECONDS)
    except (SandkernelError, OSError, asyncio.TimeoutError):
        return None


async def _why_no_host(cluster: ClusterLink, runtime: str) -> str:
    """The sentence of the 503 for a create no host took: from the up hosts the catalog lists
    (the generic sentence when it cannot be read now)."""
    return no_host_reason(runtime, await up_hosts(cluster))


def no_host_reason(runtime: str, up_hosts: Sequence[HostInfo] | None) -> str:
    """Why no host took a new ``runtime`` session, given the hosts that are up (None: unknown)."""
    if up_hosts is None:
        return f"no host of the cluster has room for a {runtime} session now (or none runs {runtime}); retry later"
    if not up_hosts:
        return "no host of the cluster is up (none has sent a heartbeat lately); retry later"
    running = [h for h in up_hosts if runtime in h.runtimes]
    if not running:
        offered = "; ".join(f"{h.host_id} runs {', '.join(h.runtimes)}" for h in up_hosts)
        return (
            f"no host of the cluster that is up runs {runtime} ({offered}): ask for a runtime (kernel) they run, "
            f"or retry once a host that runs {runtime} is up"
        )
    full = ", ".join(h.host_id for h in running)
    return f"every host that runs {runtime} is full ({full}); retry later or delete a session"
