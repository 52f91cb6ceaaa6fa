"""``sandkernel serve``: the tornado application and its lifecycle.

:class:`Gateway` is one running gateway: built from a :class:`GatewaySettings` (the only place the
operator's choices live), it opens the session catalog in its state dir, adopts every sandbox
recorded there (gateway/adoption.py), reaps the containers the catalog does not hold, then binds
(127.0.0.1 by default) and culls idle sessions. :meth:`Gateway.stop` either lets go of the
sandboxes (``--on-exit keep``, the default: running executions get ``shutdown_grace`` seconds to
finish, then are cut as ``detached``; the containers keep running and stay recorded for the next
process) or removes them all (``--on-exit delete``). :func:`serve` runs one until SIGINT/SIGTERM,
printing the URL and the token; tests, the agent CLI's local gateway and the benchmarks start one
in their own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import signal
import time
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from tornado import httpserver, web

from sandkernel import __version__
from sandkernel.errors import ConfigError, SandkernelError
from sandkernel.gateway.adoption import AdoptionReport, adopt_all
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.base import BaseHandler, NotFoundHandler, authenticate_operator
from sandkernel.gateway.channels import ChannelsHandler
from sandkernel.gateway.cluster.catalog import ClusterCatalog
from sandkernel.gateway.cluster.fast_lane import FastLane
from sandkernel.gateway.cluster.forward import ClusterLink
from sandkernel.gateway.cluster.membership import ClusterMembership
from sandkernel.gateway.cluster.postgres import PostgresStore
from sandkernel.gateway.cluster.router import ClusterRouter
from sandkernel.gateway.cluster.signing import load_cluster_secret
from sandkernel.gateway.cluster.takeover import expire_paused_of_down_hosts
from sandkernel.gateway.controls import SessionControls
from sandkernel.gateway.files_api import EgressHandler, FilesHandler, VariablesHandler
from sandkernel.gateway.http_api import MAX_DRAINED_BYTES
from sandkernel.gateway.kernels_api import (
    ApiRootHandler,
    KernelActionHandler,
    KernelHandler,
    KernelsHandler,
    KernelSpecHandler,
    KernelSpecsHandler,
)
from sandkernel.gateway.mcp.http import McpHandler, McpHttp
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.gateway.registry import SessionRegistry, starts_savable
from sandkernel.gateway.service import SessionService
from sandkernel.gateway.sessions_api import (
    ExecuteHandler,
    MarkdownHandler,
    NotebookHandler,
    ProfilesHandler,
    SessionActionHandler,
    SessionHandler,
    SessionsHandler,
    ShellHandler,
)
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.snapshots import SnapshotManager
from sandkernel.gateway.snapshots_api import SnapshotActionHandler
from sandkernel.gateway.stop_watch import bounded_stop
from sandkernel.gateway.tls import server_context
from sandkernel.gateway.traffic import Traffic
from sandkernel.kernels.durable.store import SessionStore, mark_remote_catalog, open_store
from sandkernel.kernels.egress.policy import EgressPolicy
from sandkernel.kernels.lifecycle.catalog import ProfileCatalog, choose_default_runtime
from sandkernel.kernels.lifecycle.pool import WarmPool
from sandkernel.kernels.lifecycle.reaper import reap
from sandkernel.kernels.model.profiles import Runtime
from sandkernel.kernels.model.records import SandboxState
from sandkernel.kernels.sandbox.cgroup import DEFAULT_ENGINE_PARENT, use_engine_parent
from sandkernel.kernels.sandbox.cpu_groups import remove_empty_groups
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.doctor import memory_snapshots_unavailable
from sandkernel.kernels.sandbox.service_cpu import place_gateway
from sandkernel.kernels.sandbox.state_dir import state_dir, use_state_dir
from sandkernel.kernels.snapshots.store import SnapshotStore
from sandkernel.notebooks.recorder import default_notebook_dir

log = logging.getLogger(__name__)

OPENAPI_PATH = Path(__file__).with_name("openapi.json")
# Websocket frames larger than this are refused by tornado (bytes).
WEBSOCKET_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
WEBSOCKET_PING_SECONDS = 30
# RFC 6455 "service restart": Jupyter clients reconnect after it.
CLOSE_SERVICE_RESTART = 1012
# Seconds the HTTP requests answering cut executions get to send their results on shutdown.
ANSWER_SECONDS = 5.0


class HealthHandler(BaseHandler):
    served_while_stopping = True

    def authenticate(self) -> str:
        return "anonymous"  # for load balancers and probes

    def get(self) -> None:
        """Status and version for anyone; session and pool counts only with a valid token (how
        busy a gateway is tells an outsider when to strike, and how many tenants it serves)."""
        status = "stopping" if self.registry.stopping else "ok"
        health: dict[str, Any] = {"status": status, "version": __version__}
        header = self.request.headers.get("Authorization")
        if self.auth is None or (header and self.auth.tenant_for(header) is not None):
            pool = self.registry.pool
            health.update(sessions=len(self.registry), warm_pool=len(pool) if pool is not None else 0)
            health["breakers"] = self.registry.breakers_health()
        starts = self.registry.controls.start_breaker.health() if self.registry.controls is not None else None
        if status == "ok" and starts is not None and starts.get("state") != "closed":
            health["status"] = "degraded"  # new sessions are refused until sandboxes start again
        self.write_json(health)


class MetricsHandler(BaseHandler):
    served_while_stopping = True

    def authenticate(self) -> str:
        # Aggregate numbers without tenant labels, but of every tenant: the operator's alone.
        return authenticate_operator(self, self.auth)

    async def get(self) -> None:
        self.metrics.sessions.set(len(self.registry))
        self.metrics.quarantined.set(self.registry.breakers_health()["quarantined_sessions"])
        self.metrics.paused_sessions.set(len(self.registry.paused_sessions()))
        if self.registry.snapshots is not None:
            await self.metrics.snapshot_bytes_reading.refresh(self.registry.snapshots.store.total_bytes)
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(self.metrics.render())


class OpenApiHandler(BaseHandler):
    served_while_stopping = True

    def authenticate(self) -> str:
        return "anonymous"  # the API description is public

    def get(self) -> None:
        self.write_json(json.loads(OPENAPI_PATH.read_text()))


def make_app(
    registry: SessionRegistry,
    settings: GatewaySettings,
    auth: TokenAuth | None,
    service: SessionService,
    traffic: Traffic,
    metrics: GatewayMetrics | None = None,
    mcp: McpHttp | None = None,
    router: ClusterRouter | None = None,
) -> web.Application:
    """The route table: every handler gets its dependencies through ``initialize`` (``router``:
    the cluster's, which the HTTP handlers ask where each request is served; ``traffic``: where
    requests count themselves and kernel websockets register)."""
    deps = {
        "registry": registry,
        "auth": auth,
        "settings": settings,
        "service": service,
        "traffic": traffic,
        "router": router,
    }
    api = {**deps, "metrics": metrics or GatewayMetrics()}
    kid = r"(?P<kernel_id>[^/]+)"
    sid = r"(?P<session_id>[^/]+)"
    routes: list[tuple[str, type[web.RequestHandler], dict[str, Any]]] = [
        (r"/api/?", ApiRootHandler, api),
        (r"/api/openapi.json", OpenApiHandler, api),
        (r"/api/health/?", HealthHandler, api),
        (r"/metrics/?", MetricsHandler, api),
        (r"/api/kernelspecs/?", KernelSpecsHandler, api),
        (r"/api/kernelspecs/(?P<name>[^/]+)/?", KernelSpecHandler, api),
        (r"/api/kernels/?", KernelsHandler, api),
        (rf"/api/kernels/{kid}/?", KernelHandler, api),
        (rf"/api/kernels/{kid}/(?P<action>interrupt|restart)/?", KernelActionHandler, api),
        (rf"/api/kernels/{kid}/channels", ChannelsHandler, deps),
        (r"/api/profiles/?", ProfilesHandler, api),
        (r"/api/sessions/?", SessionsHandler, api),
        (rf"/api/sessions/{sid}/?", SessionHandler, api),
        (rf"/api/sessions/{sid}/execute/?", ExecuteHandler, api),
        (rf"/api/sessions/{sid}/shell/?", ShellHandler, api),
        (rf"/api/sessions/{sid}/(?P<action>interrupt|restart)/?", SessionActionHandler, api),
        (rf"/api/sessions/{sid}/(?P<action>pause|resume|fork|rewind)/?", SnapshotActionHandler, api),
        (rf"/api/sessions/{sid}/variables/?", VariablesHandler, api),
        (rf"/api/sessions/{sid}/egress/?", EgressHandler, api),
        (rf"/api/sessions/{sid}/notebook/?", NotebookHandler, api),
        (rf"/api/sessions/{sid}/markdown/?", MarkdownHandler, api),
        (rf"/api/sessions/{sid}/files/?", FilesHandler, api),
        (rf"/api/sessions/{sid}/files/(?P<path>.+)", FilesHandler, api),
        *([(r"/mcp/?", McpHandler, {**api, "mcp": mcp})] if mcp is not None else []),
        (r".*", NotFoundHandler, api),
    ]
    return web.Application(
        routes,
        websocket_max_message_size=WEBSOCKET_MAX_MESSAGE_BYTES,
        websocket_ping_interval=WEBSOCKET_PING_SECONDS,
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


async def memory_snapshots_used(asked: str, engine: DockerEngine | None = None) -> str:
    """``on`` or ``off``: what ``--memory-snapshots`` comes to on this host. ``auto`` (the default)
    is on where the host can save gVisor kernels (gVisor 20240729+ through sandkernel's runsc
    wrapper) and off elsewhere, said once at start; an ``on`` the host cannot honour is a
    warning, and pauses, resumes and forks replay cells as with ``off``."""
    if asked == "off":
        return "off"
    why = await asyncio.to_thread(memory_snapshots_unavailable, engine)
    if why is None:
        if asked == "auto":
            log.info("memory snapshots are on (--memory-snapshots auto): gVisor sessions keep their memory")
        return "on"
    if asked == "on":
        log.warning("memory snapshots are off: %s; pauses, resumes and forks replay cells instead", why)
    else:
        log.info("memory snapshots are off (--memory-snapshots auto): %s; pauses, resumes and forks replay cells", why)
    return "off"


def load_egress_policy(path: Path | None) -> EgressPolicy | None:
    """The operator's egress policy file, validated (ConfigError says what to fix)."""
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read the egress policy {path}: {err}") from err
    return EgressPolicy.from_config(config)


async def _cull_forever(registry: SessionRegistry, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await registry.cull()
        except SandkernelError as err:  # one failed removal must not stop culling
            log.warning("culling failed: %s", err)


class Gateway:
    """One running gateway: its registry, HTTP server and culler. Start with :meth:`start`, end
    with :meth:`stop` (or ``async with``)."""

    def __init__(
        self,
        settings: GatewaySettings,
        registry: SessionRegistry,
        service: SessionService,
        traffic: Traffic,
        server: httpserver.HTTPServer,
        shown_token: str | None,
        default_runtime: str,
        store: SessionStore,
        adoption: AdoptionReport,
    ) -> None:
        self.settings = settings
        self._previous_state_dir: Path | None = None
        self._previous_engine_parent = DEFAULT_ENGINE_PARENT
        self.default_runtime = default_runtime  # what "auto" (or the operator) chose
        self.registry = registry
        self.service = service  # what every door runs code through (gateway/service.py)
        self.traffic = traffic  # the requests in flight and the open kernel websockets
        self.shown_token = shown_token  # the single token to print (None with a tokens file)
        self.store = store
        self.adoption = adoption  # what start-up found in the catalog
        self._server = server
        self._culler = asyncio.create_task(_cull_forever(registry, settings.cull_interval))
        self._stopped = False
        self.mcp: McpHttp | None = None  # /mcp, when the mcp extra is installed
        self.membership: ClusterMembership | None = None  # this host's place in a cluster, if any
        self.fast_lane: FastLane | None = None  # owns the listening socket (plain-HTTP cluster)

    @property
    def url(self) -> str:
        return f"{self.settings.scheme}://{self.settings.ip}:{self.settings.port}"

    @classmethod
    async def start(cls, settings: GatewaySettings) -> Gateway:
        """Read the operator's files (tokens, profiles, egress policy: ConfigError on a bad one),
        open the session catalog (StoreError on one that cannot be used: nothing is adopted,
        reaped or deleted then), adopt the sandboxes it records, reap the containers it does not,
        start the warm pool and only then listen on ``settings.ip:port``."""
        previous_state_dir = use_state_dir(settings.state_dir)  # before anything touches the state dir
        previous_engine_parent = use_engine_parent(settings.docker_cgroup_parent)  # before a sandbox starts
        try:
            return await cls._start(settings, previous_state_dir, previous_engine_parent)
        except BaseException:
            use_state_dir(previous_state_dir)
            use_engine_parent(previous_engine_parent)
            raise

    @classmethod
    async def _start(
        cls, settings: GatewaySettings, previous_state_dir: Path | None, previous_engine_parent: str
    ) -> Gateway:
        auth, shown_token = TokenAuth.from_sources(settings.token, settings.tokens_file)
        auth.allow_query_token = settings.allow_token_in_url
        auth.set_metrics_token(settings.metrics_token)
        tls = (  # a certificate that cannot be used stops the start before anything is adopted
            await asyncio.to_thread(server_context, settings.certfile, settings.keyfile)
            if settings.certfile is not None and settings.keyfile is not None
            else None
        )
        runtime = await choose_default_runtime(settings.default_runtime)
        memory_snapshots = await memory_snapshots_used(settings.memory_snapshots)
        settings = dataclasses.replace(settings, memory_snapshots=memory_snapshots)
        catalog = ProfileCatalog.load(settings.profiles_file, runtime, load_egress_policy(settings.egress_policy_file))
        store = await _open_store(settings)
        cluster = ClusterCatalog(store, settings.cluster_host_id) if isinstance(store, PostgresStore) else None
        membership: ClusterMembership | None = None
        fast_lane: FastLane | None = None
        mcp: McpHttp | None = None
        controls: SessionControls | None = None
        try:
            default = catalog.profile("default")
            pool = (
                WarmPool(
                    settings.pool_size,
                    default,
                    store=store,
                    preload=settings.pool_preload,
                    max_size=settings.pool_ceiling,
                    concurrency=settings.pool_refill_concurrency,
                    demand_window=settings.pool_demand_window,
                    savable=starts_savable(settings, default),
                )
                if settings.pool_size > 0
                else None
            )
            metrics = GatewayMetrics()
            controls = await asyncio.to_thread(SessionControls.from_settings, settings, metrics)
            link = None
            if cluster is not None:
                assert settings.cluster_secret_file is not None  # the settings require it with a catalog URL
                secret = await asyncio.to_thread(load_cluster_secret, settings.cluster_secret_file)
                link = ClusterLink(cluster, secret, settings.cluster_host_id, settings.cluster_url)
            snapshot_store = await asyncio.to_thread(SnapshotStore, settings.snapshot_dir)  # it reads the disk
            registry = SessionRegistry(
                settings,
                catalog,
                pool,
                metrics,
                store,
                controls,
                cluster=link,
                snapshots=lambda registry: SnapshotManager(
                    registry,
                    settings,
                    snapshot_store,
                    (lambda ttl: expire_paused_of_down_hosts(registry, link, ttl)) if link is not None else None,
                ),
            )
            snapshots = registry.snapshots
            assert isinstance(snapshots, SnapshotManager)
            records = await store.load()
            traffic = Traffic()  # the requests in flight and the kernel websockets
            report = await adopt_all(registry, records, traffic)
            log.info("start-up adoption: %s", report.summary())
            orphans = await snapshots.sweep()
            if orphans:
                log.info("removed snapshots no session names", extra={"count": len(orphans)})
            # Sandboxes another state dir's catalog records are spared by the reaper itself.
            # A paused session has no sandbox: a container of one (a crash mid-resume) goes.
            paused = {record.session_id for record in records if record.state == SandboxState.PAUSED}
            reaped = await reap(
                keep={record.session_id for record in records} - paused, sessions=paused, authoritative=state_dir()
            )
            if reaped.removed:
                log.info("reaped orphaned containers", extra={"count": len(reaped.removed)})
            service = SessionService(settings.budget, metrics)  # every door runs code through it
            mcp = await McpHttp.start(registry, settings, service)  # None without the mcp extra
            server = httpserver.HTTPServer(
                make_app(
                    registry,
                    settings,
                    auth,
                    service,
                    traffic,
                    registry.metrics,
                    mcp,
                    ClusterRouter(registry.cluster) if registry.cluster is not None else None,
                ),
                max_body_size=MAX_DRAINED_BYTES,
                idle_connection_timeout=settings.header_timeout,
                body_timeout=settings.body_timeout,
                ssl_options=tls,
            )
            try:
                if registry.cluster is not None and tls is None:  # relays what it can before tornado
                    fast_lane = FastLane(server, registry, auth, registry.cluster, settings.header_timeout, traffic)
                    fast_lane.listen(settings.port, settings.ip)
                else:
                    server.listen(settings.port, address=settings.ip)
            except OSError as err:  # in use, or an address this host does not have
                raise ConfigError(
                    f"cannot listen on {settings.ip}:{settings.port}: {err.strerror or err} "
                    "(another process holds the port, or the address is not this host's; choose another --port or --ip)"
                ) from None
            if cluster is not None:  # listening first: the others may forward to it once it is up
                membership = await _join(cluster, settings, registry)
        except BaseException:
            if fast_lane is not None:
                fast_lane.stop()
            if membership is not None:
                await membership.stop()
            if mcp is not None:
                await mcp.stop()
            if controls is not None:
                await controls.close()
            await store.close()
            raise
        if pool is not None:
            pool.start()
        gateway = cls(settings, registry, service, traffic, server, shown_token, runtime.value, store, report)
        gateway._previous_state_dir = previous_state_dir  # put back on stop (in-process gateways)
        gateway._previous_engine_parent = previous_engine_parent
        gateway.mcp = mcp
        gateway.membership = membership
        gateway.fast_lane = fast_lane
        return gateway

    async def stop(self) -> None:
        """Stop: accept no new connections, answer new requests 503 (retry), then let go of the
        sandboxes (``on_exit`` keep) or remove them (``on_exit`` delete)."""
        if self._stopped:
            return
        self._stopped = True
        self.registry.stopping = True
        self._culler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._culler
        self._server.stop()
        if self.fast_lane is not None:
            self.fast_lane.stop()
        try:
            if self.settings.on_exit == "delete":
                await self.registry.interrupt_busy(self.settings.shutdown_grace)
                await self.registry.shutdown_all()
            else:
                await self._detach()
            if self.registry.writer is not None:
                await self.registry.writer.flush()
        finally:
            if self.membership is not None:  # 'stopping': no new sessions are placed here
                await self.membership.stop()
            if self.registry.cluster is not None:  # idle kept-alive connections to the other hosts
                self.registry.cluster.peers.close()
            if self.mcp is not None:  # after the sessions' fate: an MCP session's end deletes nothing now
                await self.mcp.stop()
            if self.registry.controls is not None:
                await self.registry.controls.close()
            await self.store.close()
            await asyncio.to_thread(remove_empty_groups, self.registry.cpu_groups)
            use_state_dir(self._previous_state_dir)
            use_engine_parent(self._previous_engine_parent)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.close_all_connections(), ANSWER_SECONDS)

    async def _detach(self) -> None:
        """``on_exit`` keep: running executions get ``shutdown_grace`` seconds to finish; those
        still running are cut (their callers get status ``detached``, ended_by
        ``gateway_restart``; the code keeps running), websockets close with 1012 so Jupyter
        clients reconnect to the next process, and every session lets go of its sandbox, which
        keeps running, recorded in the catalog with the time it was let go."""
        started = time.monotonic()
        still_running = await self.registry.settle(self.settings.shutdown_grace)
        for managed in still_running:
            log.info("cutting a running execution: the gateway is restarting", extra={"session": managed.id})
        await asyncio.gather(*(m.session.cut_running() for m in still_running), return_exceptions=True)
        await self.traffic.requests_done(ANSWER_SECONDS)  # the cut executions' callers get their result
        for handler in list(self.traffic.websockets):
            with contextlib.suppress(Exception):
                handler.close(CLOSE_SERVICE_RESTART, "service restart")
        count = len(self.registry)
        await self.registry.detach_all()
        log.info(
            "gateway stopped: %d session(s) left running for the next gateway (%d cut) in %.2fs",
            count,
            len(still_running),
            time.monotonic() - started,
        )

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _open_store(settings: GatewaySettings) -> SessionStore:
    """The session catalog: the cluster's PostgreSQL (this host's rows) with ``catalog_url``,
    else the SQLite file in the state dir."""
    if settings.catalog_url is not None:
        store = await PostgresStore.open(settings.catalog_url, settings.cluster_host_id)
        # So a reaper on this engine (another process, `sandkernel reap`) keeps this host's
        # sandboxes while this gateway restarts: their records are not in a SQLite file here.
        await asyncio.to_thread(mark_remote_catalog)
        return store
    return await asyncio.to_thread(open_store)


async def _join(cluster: ClusterCatalog, settings: GatewaySettings, registry: SessionRegistry) -> ClusterMembership:
    """Register this host (its URL, the runtimes its engine has, its capacity) and start beating."""
    engine = default_engine()
    registered = await engine.run(engine.runtimes_sync)
    runtimes = [runtime.value for runtime in Runtime if runtime.value in registered or runtime is Runtime.RUNC]
    membership = ClusterMembership(
        cluster,
        host_id=settings.cluster_host_id,
        url=settings.cluster_url,
        runtimes=runtimes,
        capacity=settings.max_sessions_total,
        load=registry.load,
        interval=settings.heartbeat_seconds,
        down_after=settings.host_down_after,
        on_return=registry.declare_lost,
        snapshot_store=registry.snapshots.store.store_id if registry.snapshots is not None else None,
    )
    await membership.start()
    return membership


async def serve(settings: GatewaySettings, stop: asyncio.Event | None = None) -> None:
    """Run a gateway until SIGINT/SIGTERM (or until ``stop`` is set), saying where it is."""
    # Its own CPU group, above any one tenant's: it carries every tenant's calls (service_cpu.py).
    log.info("%s", await asyncio.to_thread(place_gateway))
    gateway = await Gateway.start(settings)
    # What start-up made (modules, classes, settings) lives as long as the process: frozen out of
    # the cyclic collector, a full collection scans only what sessions made since. Each one is a
    # pause of the event loop, hence of every tenant's call: measured under bench/noisy_neighbour.py,
    # 40-120 ms before, 13-19 ms after.
    gc.collect()
    gc.freeze()
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    catalog = gateway.registry.catalog
    print(f"sandkernel gateway at {gateway.url}", flush=True)
    print(f"notebooks: {settings.notebook_dir or default_notebook_dir()}", flush=True)
    print(f"default runtime: {gateway.default_runtime}; profiles: {', '.join(sorted(catalog.profiles))}", flush=True)
    print(f"state dir: {state_dir()}; {gateway.adoption.summary()}", flush=True)
    if gateway.shown_token:
        print(f"token: {gateway.shown_token}", flush=True)
        print(
            f"JupyterLab: jupyter lab --gateway-url={gateway.url} --GatewayClient.auth_token={gateway.shown_token}",
            flush=True,
        )
    if gateway.registry.pool is not None:
        print(
            f"warm pool: {settings.pool_size} sandbox(es) of the default profile (up to {settings.pool_ceiling} "
            f"under demand), filling in the background",
            flush=True,
        )
    try:
        await stop.wait()
    finally:
        log.info("stopping (shutdown grace %.0f s)", settings.shutdown_grace)
        await bounded_stop(gateway.stop(), settings.shutdown_grace)
        if settings.on_exit == "delete":
            print("gateway stopped; all sessions shut down", flush=True)
        else:
            print(f"gateway stopped; sessions left running, recorded in {state_dir()} for the next gateway", flush=True)
