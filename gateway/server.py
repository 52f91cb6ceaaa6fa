"""``sandkernel serve``: the tornado application and its lifecycle.

Binds 127.0.0.1 by default, prints the URL and the token, reaps containers orphaned by a
crashed predecessor at start, and shuts every session down on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from tornado import httpserver, web

from sandkernel import __version__
from sandkernel.errors import SandkernelError
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.base import MAX_BODY_BYTES, BaseHandler, NotFoundHandler
from sandkernel.gateway.budget import OutputBudget
from sandkernel.gateway.channels import MAX_CONNECTIONS_PER_KERNEL, ChannelsHandler
from sandkernel.gateway.files_api import EgressHandler, FilesHandler, VariablesHandler
from sandkernel.gateway.kernels_api import (
    ApiRootHandler,
    KernelActionHandler,
    KernelHandler,
    KernelsHandler,
    KernelSpecHandler,
    KernelSpecsHandler,
)
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.registry import SessionRegistry
from sandkernel.gateway.sessions_api import (
    ExecuteHandler,
    MarkdownHandler,
    NotebookHandler,
    ProfilesHandler,
    SessionActionHandler,
    SessionHandler,
    SessionsHandler,
)
from sandkernel.kernels.egress.policy import EgressPolicy
from sandkernel.kernels.lifecycle.catalog import ProfileCatalog, choose_default_runtime
from sandkernel.kernels.lifecycle.pool import WarmPool
from sandkernel.kernels.lifecycle.reaper import reap
from sandkernel.notebooks.recorder import default_notebook_dir

log = logging.getLogger(__name__)

OPENAPI_PATH = Path(__file__).with_name("openapi.json")


class HealthHandler(BaseHandler):
    def authenticate(self) -> str:
        return "anonymous"  # for load balancers and probes

    def get(self) -> None:
        """Status and version for anyone; session and pool counts only with a valid token (how
        busy a gateway is tells an outsider when to strike, and how many tenants it serves)."""
        health: dict[str, Any] = {"status": "ok", "version": __version__}
        header = self.request.headers.get("Authorization")
        if self.auth is None or (header and self.auth.tenant_for(header) is not None):
            pool = self.registry.pool
            health.update(sessions=len(self.registry), warm_pool=len(pool) if pool else 0)
        self.write_json(health)


class MetricsHandler(BaseHandler):
    def authenticate(self) -> str:
        return "anonymous"  # aggregate numbers only, no tenant labels

    def get(self) -> None:
        metrics: GatewayMetrics = self.settings_["metrics"]
        metrics.sessions.set(len(self.registry))
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(metrics.render())


class OpenApiHandler(BaseHandler):
    def authenticate(self) -> str:
        return "anonymous"  # the API description is public

    def get(self) -> None:
        self.write_json(json.loads(OPENAPI_PATH.read_text()))


def make_app(
    registry: SessionRegistry, auth: TokenAuth | None, config: dict[str, Any] | None = None
) -> web.Application:
    config = dict(config or {})
    config.setdefault("metrics", GatewayMetrics())
    config.setdefault("budget", OutputBudget())
    deps = {"registry": registry, "auth": auth, "config": config}
    kid = r"(?P<kernel_id>[^/]+)"
    sid = r"(?P<session_id>[^/]+)"
    routes = [
        (r"/api/?", ApiRootHandler),
        (r"/api/openapi.json", OpenApiHandler),
        (r"/api/health/?", HealthHandler),
        (r"/metrics/?", MetricsHandler),
        (r"/api/kernelspecs/?", KernelSpecsHandler),
        (r"/api/kernelspecs/(?P<name>[^/]+)/?", KernelSpecHandler),
        (r"/api/kernels/?", KernelsHandler),
        (rf"/api/kernels/{kid}/?", KernelHandler),
        (rf"/api/kernels/{kid}/(?P<action>interrupt|restart)/?", KernelActionHandler),
        (rf"/api/kernels/{kid}/channels", ChannelsHandler),
        (r"/api/profiles/?", ProfilesHandler),
        (r"/api/sessions/?", SessionsHandler),
        (rf"/api/sessions/{sid}/?", SessionHandler),
        (rf"/api/sessions/{sid}/execute/?", ExecuteHandler),
        (rf"/api/sessions/{sid}/(?P<action>interrupt|restart)/?", SessionActionHandler),
        (rf"/api/sessions/{sid}/variables/?", VariablesHandler),
        (rf"/api/sessions/{sid}/egress/?", EgressHandler),
        (rf"/api/sessions/{sid}/notebook/?", NotebookHandler),
        (rf"/api/sessions/{sid}/markdown/?", MarkdownHandler),
        (rf"/api/sessions/{sid}/files/?", FilesHandler),
        (rf"/api/sessions/{sid}/files/(?P<path>.+)", FilesHandler),
        (r".*", NotFoundHandler),
    ]
    return web.Application(
        [(pattern, handler, deps) for pattern, handler in routes],
        websocket_max_message_size=16 * 1024 * 1024,
        websocket_ping_interval=30,
        log_function=log_request,
    )


access_log = logging.getLogger("tornado.access")


def log_request(handler: web.RequestHandler) -> None:
    """One access-log line per request, with the path but never the query string: a refused
    ``?token=`` (or any secret a client put in a URL) must not end up in the log."""
    status = handler.get_status()
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    access_log.log(
        level,
        "%d %s %s (%s) %.2fms",
        status,
        handler.request.method,
        handler.request.path,
        handler.request.remote_ip,
        1000.0 * handler.request.request_time(),
    )


# A client has this long to send a request's headers, and to stay idle between requests
# (seconds): slow-header clients (slowloris) cannot hold connections open for an hour.
HEADER_TIMEOUT = 20.0
# ... and this long to send a body (up to MAX_BODY_BYTES).
BODY_TIMEOUT = 300.0


CULL_INTERVAL = 30.0


async def _cull_forever(registry: SessionRegistry, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await registry.cull()
        except SandkernelError as err:  # one failed removal must not stop culling
            log.warning("culling failed: %s", err)


async def serve(
    ip: str = "127.0.0.1",
    port: int = 8888,
    token: str | None = None,
    tokens_file: str | None = None,
    max_sessions: int = 20,
    budget: OutputBudget | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    max_sessions_total: int = 100,
    idle_timeout: float | None = 3600.0,
    max_lifetime: float | None = 24 * 3600.0,
    shutdown_grace: float = 10.0,
    cull_interval: float = CULL_INTERVAL,
    notebook_dir: Path | None = None,
    announce: bool = True,
    allow_token_in_url: bool = False,
    allow_origins: tuple[str, ...] = (),
    max_connections_per_kernel: int = MAX_CONNECTIONS_PER_KERNEL,
    egress_policy: EgressPolicy | None = None,
    pool_size: int = 0,
    profiles_file: str | None = None,
    default_runtime: str | None = None,
    header_timeout: float = HEADER_TIMEOUT,
) -> None:
    """Run the gateway until SIGINT/SIGTERM (or ``stop`` is set).

    ``profiles_file`` is the operator's profiles and ceilings (see kernels/lifecycle/catalog.py);
    ``default_runtime`` ("auto": gVisor where registered; None: $SANDKERNEL_RUNTIME, else auto)
    the runtime of profiles that name none.
    On stop: accept no new connections, interrupt running executions and give them
    ``shutdown_grace`` seconds to return their results, then remove every container."""
    auth, shown_token = TokenAuth.from_sources(token, tokens_file)
    auth.allow_query_token = allow_token_in_url
    runtime = await choose_default_runtime(default_runtime)
    catalog = ProfileCatalog.load(profiles_file, runtime, egress_policy)
    report = await reap()
    if report.removed:
        log.info("reaped orphaned containers", extra={"count": len(report.removed)})
    pool = WarmPool(pool_size, catalog.profile("default")) if pool_size > 0 else None
    registry = SessionRegistry(
        max_sessions, max_sessions_total, idle_timeout, max_lifetime, notebook_dir, pool, catalog
    )
    app = make_app(
        registry,
        auth,
        {
            "budget": budget or OutputBudget(),
            "allow_origins": tuple(allow_origins),
            "max_connections_per_kernel": max_connections_per_kernel,
        },
    )
    server = httpserver.HTTPServer(
        app, max_body_size=MAX_BODY_BYTES * 2, idle_connection_timeout=header_timeout, body_timeout=BODY_TIMEOUT
    )
    server.listen(port, address=ip)
    if stop is None:  # run as a program: stop on SIGINT/SIGTERM
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    url = f"http://{ip}:{port}"
    if announce:
        print(f"sandkernel gateway at {url}", flush=True)
        print(f"notebooks: {notebook_dir or default_notebook_dir()}", flush=True)
        print(f"default runtime: {runtime.value}; profiles: {', '.join(sorted(catalog.profiles))}", flush=True)
        if shown_token:
            print(f"token: {shown_token}", flush=True)
            print(f"JupyterLab: jupyter lab --gateway-url={url} --GatewayClient.auth_token={shown_token}", flush=True)
    if pool is not None:
        pool.start()
        if announce:
            print(f"warm pool: {pool_size} sandbox(es) of the default profile, filling in the background", flush=True)
    if ready is not None:
        ready.set()
    culler = asyncio.create_task(_cull_forever(registry, cull_interval))
    try:
        await stop.wait()
    finally:
        culler.cancel()
        server.stop()
        await registry.interrupt_busy(shutdown_grace)
        await registry.shutdown_all()
        if announce:
            print("gateway stopped; all sessions shut down", flush=True)
