"""The Swarm task that runs a host's gateway: ``sandkernel cluster launch``.

Why a launcher at all: a gateway mounts a small tmpfs per kernel runtime dir and loop-mounts the
workspace disks, so its container needs ``CAP_SYS_ADMIN``, the loop devices (the host's ``/dev``,
which is where loop devices made on demand appear, with a device-cgroup rule for loop devices
only) and no AppArmor mount ban; Swarm's service spec (Docker 20.10) can add the capability but
has no devices and no device-cgroup rules. So the stack's global service runs this launcher,
unprivileged, with only the host's ``docker.sock``; it starts the gateway as a sibling container
on its own engine (:data:`GATEWAY_CONTAINER`) with exactly those grants, and lives exactly as long
as it does. Not ``--privileged``: it would grant every device and capability, and on a host whose
own capability bounding set is short (this project's CI machine lacks ``CAP_SYS_RESOURCE``) runc
cannot even start a privileged container ("unable to apply caps"). Swarm still does what the
issue asks of the engine: it runs one launcher per node, restarts it when it exits, and rolls
upgrades through it (``stop-first``).

The lifetime rule, one gateway per host:
- at start, a gateway left by a launcher that was killed is stopped first (its ``--shutdown-grace``
  honoured) and removed, so two gateways never share a host id;
- SIGTERM (Swarm stopping the task) stops the gateway the same way, then the launcher exits 0;
- the gateway exiting on its own (a crash, a kill) ends the launcher with its exit code, and
  Swarm's restart policy starts a new launcher, which starts a new gateway that re-adopts the
  host's sessions (durable sessions).

Secrets: Swarm mounts the stack's secrets into this task only (``/run/secrets``). The launcher
copies them into the gateway container before it starts (``put_archive``, mode 0400, root), next to
a generated config file, so the catalog URL with its password is never on a command line or in an
environment variable. Blocking Docker calls are fine here: this is a one-job process, not the
gateway's event loop.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import queue
import re
import signal
import sys
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from sandkernel.kernels.sandbox.cgroup import check_engine_parent
from sandkernel.kernels.sandbox.docker_engine import CONNECTION_ERRORS

log = logging.getLogger(__name__)

_CONTAINER_FILE = re.compile(r"/containers/([0-9a-f]{64})/(?:hostname|hosts|resolv\.conf)\s")

GATEWAY_CONTAINER = "sandkernel-gateway"
ROLE_LABEL = "sandkernel.role"
CONFIG_DIR = "/etc/sandkernel"  # inside the gateway container: config file and secrets, 0700
SECRETS_DIR = Path("/run/secrets")  # where Swarm mounts the stack's secrets into the launcher
# Swarm secret file name -> the gateway setting it feeds (the file's path, or its text for the URL).
SECRET_SETTINGS = {
    "catalog_url": "catalog_url",
    "cluster_secret": "cluster_secret_file",
    "tokens": "tokens_file",
    "tls_cert": "certfile",  # optional, with tls_key: HTTPS and an https:// advertise URL
    "tls_key": "keyfile",
}
REQUIRED_SECRETS = ("catalog_url", "cluster_secret")
# Optional: the CA the gateways check each other's certificates with (the gateway's SSL_CERT_FILE).
CLUSTER_CA_SECRET = "cluster_ca"
# Host paths the gateway shares with its engine at the same path (dockerd resolves bind sources
# on the host, so what the gateway mounts under them must propagate back: rshared).
STATE_DIR = "/var/lib/sandkernel"
SHARED_HOST_DIRS = (STATE_DIR, "/run/sandkernel")
DOCKER_SOCKET = "/var/run/docker.sock"
GATEWAY_CAPABILITIES = ("SYS_ADMIN",)  # mount(2): runtime-dir tmpfs, workspace disks (+ Docker's defaults)
LOOP_DEVICE_RULES = ("b 7:* rwm", "c 10:237 rwm")  # loop devices and /dev/loop-control, nothing else
CGROUP_ROOT = "/sys/fs/cgroup"  # the sandboxes' cgroups, read and reset per cell (kernels/sandbox/cgroup.py)


class LaunchError(Exception):
    """The launcher cannot start the gateway; the message says what to fix."""


@dataclass(frozen=True)
class LaunchPlan:
    """What the gateway container is started with; built from the node and the secrets."""

    image: str
    host_id: str
    advertise_url: str
    port: int
    config: dict[str, Any]
    files: dict[str, bytes] = field(repr=False)  # name under CONFIG_DIR -> content (secrets included)
    serve_args: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        return ["serve", "--config", f"{CONFIG_DIR}/gateway.json", *self.serve_args]


def own_container_id(mountinfo: str) -> str | None:
    """This process's container id, from the files Docker bind-mounts into every container
    (``/etc/hostname`` comes from ``.../containers/<id>/hostname``). The host name is no use: on
    the host network it is the node's."""
    found = _CONTAINER_FILE.search(mountinfo)
    return found.group(1) if found else None


def engine_cgroup_parent(proc_cgroup: str, container_id: str | None) -> str | None:
    """The engine's cgroup parent (dockerd's ``--cgroup-parent``, ``/docker`` by default) as seen
    from ``/proc/self/cgroup`` of this launcher, which the engine started in its default place:
    ``/sklab-h1`` from ``4:cpu,cpuacct:/sklab-h1/<own id>``. None where that cannot be seen: cgroup
    v2 (Docker gives each container a cgroup namespace of its own, so the path reads ``/``), the
    systemd driver (``docker-<id>.scope``), or no container id. The gateway is told it, so the
    tenants' CPU groups go where the operator put the engine's containers, not beside them."""
    if container_id is None:
        return None
    for line in proc_cgroup.splitlines():
        path = line.split(":", 2)[-1]
        if path.endswith(f"/{container_id}"):
            parent = path[: -len(container_id) - 1]
            try:
                return check_engine_parent(parent)
            except ValueError:
                return None
    return None


def own_image(client: docker.DockerClient) -> str:
    """The image this launcher runs from, by the name the service gave it (the gateway runs the
    same one, so a service update of the image is a gateway upgrade)."""
    container_id = own_container_id(Path("/proc/self/mountinfo").read_text())
    try:
        if container_id is None:
            raise docker.errors.NotFound("no container id in /proc/self/mountinfo")
        return str(client.containers.get(container_id).attrs["Config"]["Image"])
    except docker.errors.NotFound:
        raise LaunchError("cannot find the launcher's own container to learn its image; pass --image") from None


def node_identity(client: docker.DockerClient) -> tuple[str, str]:
    """This node's name (the host id: stable across restarts and upgrades) and its Swarm address."""
    info = client.info()
    swarm = info.get("Swarm") or {}
    address = swarm.get("NodeAddr") or ""
    if swarm.get("LocalNodeState") != "active" or not address:
        raise LaunchError("this engine is not an active Swarm node (`sandkernel cluster launch` is a Swarm task)")
    return str(info["Name"]), str(address)


def read_secrets(directory: Path) -> dict[str, bytes]:
    """The stack's secrets this launcher was given; the required ones must be there."""
    found = {}
    for name in (*SECRET_SETTINGS, CLUSTER_CA_SECRET):
        path = directory / name
        if path.is_file():
            found[name] = path.read_bytes()
    missing = [name for name in REQUIRED_SECRETS if name not in found]
    if missing:
        raise LaunchError(
            f"missing Swarm secret(s) {', '.join(missing)} in {directory}: the stack must give the gateway service "
            "the secrets catalog_url and cluster_secret (see `sandkernel cluster stack`)"
        )
    if ("tls_cert" in found) != ("tls_key" in found):
        raise LaunchError(
            f"the secrets tls_cert and tls_key come together (HTTPS needs both) in {directory}: give the gateway "
            "service both, or neither (see `sandkernel cluster up --tls-cert`)"
        )
    return found


def make_plan(
    client: docker.DockerClient,
    *,
    port: int,
    image: str | None,
    secrets_dir: Path,
    serve_args: tuple[str, ...] = (),
) -> LaunchPlan:
    host_id, address = node_identity(client)
    secrets = read_secrets(secrets_dir)
    scheme = "https" if "tls_cert" in secrets else "http"  # the other gateways then forward over TLS
    advertise_url = f"{scheme}://{address}:{port}"
    config: dict[str, Any] = {
        "ip": "0.0.0.0",  # the host's network: reached by clients and by the other gateways
        "port": port,
        "host_id": host_id,
        "advertise_url": advertise_url,
        "on_exit": "keep",  # a stop or an upgrade keeps the sessions for the next gateway
        "state_dir": STATE_DIR,
        "notebook_dir": f"{STATE_DIR}/notebooks",  # on the host: transcripts outlive the gateway container
        "catalog_url": secrets["catalog_url"].decode().strip(),
    }
    files = {}
    for name, setting in SECRET_SETTINGS.items():
        if name in secrets and setting != "catalog_url":
            files[name] = secrets[name]
            config[setting] = f"{CONFIG_DIR}/{name}"
    environment = {}
    if CLUSTER_CA_SECRET in secrets:  # the trust store the gateway checks its peers' certificates with
        files[CLUSTER_CA_SECRET] = secrets[CLUSTER_CA_SECRET]
        environment["SSL_CERT_FILE"] = f"{CONFIG_DIR}/{CLUSTER_CA_SECRET}"
    own_id = own_container_id(Path("/proc/self/mountinfo").read_text())
    engine_parent = engine_cgroup_parent(Path("/proc/self/cgroup").read_text(), own_id)
    if engine_parent is not None:
        config["docker_cgroup_parent"] = engine_parent
    files["gateway.json"] = json.dumps(config, indent=2).encode()
    return LaunchPlan(image or own_image(client), host_id, advertise_url, port, config, files, serve_args, environment)


def _config_archive(files: dict[str, bytes]) -> bytes:
    """A tar of CONFIG_DIR (0700) holding ``files`` (0400), all root's."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        directory = tarfile.TarInfo(CONFIG_DIR.strip("/"))
        directory.type, directory.mode = tarfile.DIRTYPE, 0o700
        tar.addfile(directory)
        for name, content in files.items():
            info = tarfile.TarInfo(f"{CONFIG_DIR.strip('/')}/{name}")
            info.size, info.mode = len(content), 0o400
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def stop_gateway(client: docker.DockerClient, timeout: float) -> None:
    """Stop and remove this host's gateway container if one is there (SIGTERM, then SIGKILL after
    ``timeout``: the gateway's own shutdown grace must fit in it)."""
    try:
        container = client.containers.get(GATEWAY_CONTAINER)
    except docker.errors.NotFound:
        return
    log.info("stopping the gateway container %s (%s)", container.short_id, container.status)
    try:
        container.stop(timeout=int(timeout))
        container.remove(force=True)
    except docker.errors.NotFound:
        pass


def start_gateway(client: docker.DockerClient, plan: LaunchPlan) -> Any:
    """Create the gateway container (host network, the grants above, the host paths it shares
    with its engine), copy its config and secrets in, start it."""
    binds = {DOCKER_SOCKET: {"bind": DOCKER_SOCKET, "mode": "rw"}, "/dev": {"bind": "/dev", "mode": "rw"}}
    binds[CGROUP_ROOT] = {"bind": CGROUP_ROOT, "mode": "rw"}
    for path in SHARED_HOST_DIRS:
        binds[path] = {"bind": path, "mode": "rw,rshared"}
    try:
        container = client.containers.create(
            plan.image,
            plan.command(),
            name=GATEWAY_CONTAINER,
            cap_add=list(GATEWAY_CAPABILITIES),
            device_cgroup_rules=list(LOOP_DEVICE_RULES),
            security_opt=["apparmor=unconfined"],  # docker-default AppArmor denies mount(2)
            network_mode="host",
            volumes=binds,
            environment=plan.environment,
            labels={ROLE_LABEL: "gateway", "sandkernel.host-id": plan.host_id},
            restart_policy={"Name": "no"},
            log_config={"Type": "json-file", "Config": {"max-size": "20m", "max-file": "3"}},
        )
    except docker.errors.APIError as err:
        raise LaunchError(f"cannot create the gateway container: {err.explanation or err}") from None
    try:
        container.put_archive("/", _config_archive(plan.files))
        container.start()
    except docker.errors.APIError as err:
        container.remove(force=True)
        raise LaunchError(f"cannot start the gateway container: {err.explanation or err}") from None
    return container


def _relay_logs(container: Any) -> None:
    """The gateway's output on the launcher's, so `docker service logs` shows it."""
    try:
        for chunk in container.logs(stream=True, follow=True):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    except (docker.errors.APIError, OSError, ValueError):
        pass


def _watch_exit(container: Any, events: queue.SimpleQueue[tuple[str, Any]]) -> None:
    """Wait, in the engine, for the gateway container to stop, then tell the launcher at once:
    ``("exited", code)``, ``("removed", None)`` when someone removed it, ``("lost", why)`` when the
    wait itself broke (the engine went away). One blocking request, no polling: the engine answers
    ``POST /containers/<id>/wait`` when the container stops (``timeout=None``: as long as it runs)."""
    try:
        status = container.wait(timeout=None)
    except docker.errors.NotFound:
        events.put(("removed", None))
    except (docker.errors.APIError, *CONNECTION_ERRORS) as err:
        events.put(("lost", str(err)))
    else:
        events.put(("exited", int(status.get("StatusCode", 1))))


def launch(
    *,
    port: int,
    image: str | None = None,
    secrets_dir: Path = SECRETS_DIR,
    stop_timeout: float = 45.0,
    serve_args: tuple[str, ...] = (),
    client: docker.DockerClient | None = None,
) -> int:
    """Run this host's gateway until it exits (its exit code) or the launcher is told to stop (0).

    The main thread sleeps on one queue fed by the signal handler and by :func:`_watch_exit`'s
    thread (``SimpleQueue.put`` is safe in a signal handler), so it reacts to either at once and
    does nothing in between."""
    client = client or docker.from_env(timeout=max(120, int(stop_timeout) + 30))
    plan = make_plan(client, port=port, image=image, secrets_dir=secrets_dir, serve_args=serve_args)
    stop_gateway(client, stop_timeout)  # one left by a launcher that was killed
    events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    def on_signal(signum: int, _frame: object) -> None:
        events.put(("signal", signum))

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    container = start_gateway(client, plan)
    log.info("gateway %s started: host %s at %s (%s)", container.short_id, plan.host_id, plan.advertise_url, plan.image)
    threading.Thread(target=_relay_logs, args=(container,), daemon=True, name="gateway-logs").start()
    threading.Thread(target=_watch_exit, args=(container, events), daemon=True, name="gateway-wait").start()
    kind, value = events.get()
    if kind == "signal":
        log.info("signal %d: stopping the gateway", value)
        stop_gateway(client, stop_timeout)  # its sessions stay (on_exit keep) for the next gateway
        return 0
    if kind == "removed":
        log.error("the gateway container was removed by someone else")
        return 1
    if kind == "lost":
        log.error("lost the engine's wait on the gateway container (%s); exiting so Swarm starts a new launcher", value)
        return 1
    log.warning("the gateway exited with code %d", value)
    with contextlib.suppress(docker.errors.NotFound):
        container.remove(force=True)
    return value or 1  # a gateway that stopped on its own is restarted by Swarm either way
