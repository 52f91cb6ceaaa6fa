"""A three-host Docker Swarm on one machine, for the cluster tests (issue 18).

Each "host" is a Docker engine of its own, started by the tests and thrown away by them:

* its own **network namespace** (``sklab-h1`` ...), wired by a veth to a bridge inside a
  dedicated switch namespace (``sklab-sw``). Addresses are private (:data:`LAB_NET`, 10.213/16),
  no namespace of the lab has a default route, and nothing is NATed out: no packet of the lab
  can leave the machine. The root namespace gets one veth (``sklab0``, 10.213.0.254/24, the
  kernel's connected route and nothing else) so the test process can reach each host's
  published ports; IPv4 forwarding is switched off on that interface, so even a lab namespace
  that added a route through it could not be forwarded anywhere. The root namespace's routes
  and iptables are never touched otherwise (each engine's iptables rules live in its own
  namespace).
* its own **dockerd** with its own ``--data-root``, ``--exec-root``, pid file, unix socket,
  ``--cgroup-parent`` (``/sklab-h1``: cgroup v1 with cgroupfs, so the engines' containers
  never share a cgroup) and its **own containerd** (dockerd 20.10 starts one under its
  exec-root when ``--containerd`` is not given). The daemon runs in its own UTS namespace
  (hostname ``sklab-hN``, so ``docker node ls`` tells the hosts apart) and its own mount
  namespace, where a private directory is bind-mounted over ``/etc/docker``: the main
  engine's configuration and ``key.json`` are neither read nor written, and every mount the
  engine makes (overlay2 layers, network namespaces) dies with that namespace. ``/run/containerd``
  is private too (the shims' sockets).
* gVisor registered exactly as on the main engine: the ``runtimes`` of
  ``/etc/docker/daemon.json`` (written by scripts/host-setup.sh) copied into the engine's own
  config file, on the hosts chosen to have it (:attr:`Lab.runsc_hosts`); those hosts get the
  node label ``sandkernel.runsc=true`` (:data:`RUNSC_LABEL`), the placement constraint for
  gVisor services.

There is no registry: images are ``docker save``d from the main engine and ``docker load``ed
into each lab engine (:meth:`Lab.load_image`). Swarm tasks never try to pull
(``DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1``) and services are created with
``--no-resolve-image``.

One lab per machine at a time: a lab holds the abstract unix socket ``@sklab.lab-lock`` from
up() to down() (the kernel drops it when the process dies, so a crash never leaves it held); a
second lab, from another test process, waits for it. Everything the lab creates is named from
its prefix, so :meth:`Lab.up`, once it holds the lock, first removes what a crashed run left
behind, and :meth:`Lab.down` leaves nothing (:meth:`Lab.leftovers` says what, if anything, is
left: found from /proc, /run/netns and the cgroup tree, see :mod:`.traces`). Root is required
(namespaces, mounts, dockerd); without it up() fails with a clear message, never a silent skip.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import network, traces
from .commands import LabError, run, wait_for

log = logging.getLogger(__name__)

PREFIX = "sklab"
LAB_NET = ipaddress.ip_network("10.213.0.0/16")  # every address the lab uses, and nothing else
SWITCH_NET = ipaddress.ip_network("10.213.0.0/24")  # the hosts' "LAN": host N is .N, the root ns .254
BRIDGE_POOL = "10.213.128.0/18"  # each engine's local networks (docker_gwbridge); per netns, may repeat
SWARM_POOL = "10.213.192.0/18"  # the swarm's overlay networks
RUNSC_LABEL = "sandkernel.runsc"
BASE_IMAGE = "sandkernel-base:bookworm"
KERNEL_IMAGE = "sandkernel-kernel:0.1.0"
MAIN_DAEMON_JSON = Path("/etc/docker/daemon.json")
HOST_DOCKER_SOCKET = "/run/docker.sock"  # where a host's containers expect their engine (/var/run links here)
MAX_HOSTS = 20  # host N's docker0 is 10.213.(10+N).1/24, below BRIDGE_POOL

# Run inside the engine's new UTS and mount namespaces (already in its network namespace), as
# sh -c WRAPPER sh HOSTNAME EXEC_ROOT SANDKERNEL_DIR dockerd ARGS...: its own hostname; a private /etc/docker;
# a private /run/containerd (containerd's shims put their sockets in /run/containerd/s whatever
# containerd's own paths are, and a SIGKILLed shim leaves its socket there: found the hard way);
# a sysfs of its own network namespace (what `ip netns exec` does too, but that one drops the
# cgroup mounts, and dockerd refuses to start without them: "Devices cgroup isn't mounted"), so
# the cgroup tree is moved over onto the new /sys. And a sandkernel gateway of its own: the
# host's /var/lib/sandkernel and /run/sandkernel are private directories of this host (SANDKERNEL_DIR,
# on the lab's tmpfs), made shared mounts in its namespace so a gateway container can bind them
# ``rshared`` as on a real host (Docker refuses rshared on a mount that is not shared). One
# directory of the machine is every host's /var/lib/sandkernel/snapshots, as an NFS mount on each
# node would be: a paused session of a dead host resumes on another (docs/snapshots.md).
_DAEMON_WRAPPER = """set -e
hostname "$1"
mkdir -p "$2/etc-docker" "$2/run-containerd" "$2/cgroup" /run/containerd
mount --bind "$2/etc-docker" /etc/docker
mount --bind "$2/run-containerd" /run/containerd
mount --rbind /sys/fs/cgroup "$2/cgroup"
umount -l /sys
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount --move "$2/cgroup" /sys/fs/cgroup
mkdir -p "$3/state" "$3/run" /var/lib/sandkernel /run/sandkernel
mount --bind "$3/state" /var/lib/sandkernel
mount --make-shared /var/lib/sandkernel
mount --bind "$3/run" /run/sandkernel
mount --make-shared /run/sandkernel
mkdir -p "$4" /var/lib/sandkernel/snapshots
mount --bind "$4" /var/lib/sandkernel/snapshots
shift 4
exec "$@"
"""


@dataclass(frozen=True)
class LabHost:
    """One engine of the lab. ``index`` is 1-based; ``name`` is its netns, hostname and swarm node name."""

    index: int
    name: str
    ip: str
    socket: Path
    data_root: Path
    exec_root: Path
    runsc: bool

    @property
    def sandkernel_dir(self) -> Path:
        """This host's /var/lib/sandkernel (``state``) and /run/sandkernel (``run``), seen from the
        machine: a gateway running on the host (as a container) keeps its state here."""
        return self.data_root.with_name(f"{self.name}-sandkernel")

    @property
    def docker_host(self) -> str:
        """The ``DOCKER_HOST`` value (``-H``) that reaches this engine."""
        return f"unix://{self.socket}"


def main_runtimes() -> dict[str, dict]:
    """The extra runtimes the main engine registers (``/etc/docker/daemon.json``'s ``runtimes``),
    read at call time: the lab registers gVisor exactly as the main engine does, from one place."""
    try:
        return dict(json.loads(MAIN_DAEMON_JSON.read_text()).get("runtimes", {}))
    except FileNotFoundError:
        return {}


def docker_env() -> dict[str, str]:
    """This process's environment for the docker CLI, minus what could point it at another engine."""
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_TLS_VERIFY")}
    env["DOCKER_CLI_HINTS"] = "false"
    return env


class Lab:
    """A throwaway Docker Swarm of ``hosts`` engines on this machine (see the module docstring).

    ``managers``: how many hosts join as managers (default all: with 3 managers the swarm keeps
    its quorum when a test stops one host). ``runsc_hosts``: the 1-based hosts with gVisor
    registered and labelled (default: all of them if the main engine has runsc, else none).
    ``images``: loaded into every engine by :meth:`up`. ``tmpfs_size``: the data roots live on a
    tmpfs of that size (RAM is used only as written: about the images' size per host), so the
    teardown is an unmount instead of deleting some 10,000 layer files per host from disk
    (6.7 s for the base image on three hosts); None keeps them on disk. ``lock_timeout``: how
    long up() waits for another process's lab to go. Timings (seconds) are kept in
    :attr:`timings`. Synchronous on purpose: a fixture drives it outside any event loop, and
    every step is a subprocess.
    """

    _active: Lab | None = None  # the lab this process holds (the lock is machine-wide, not re-entrant)

    def __init__(self, hosts: int = 3, *, managers: int | None = None, runsc_hosts: Iterable[int] | None = None,
                 images: Sequence[str] = (BASE_IMAGE,), prefix: str = PREFIX,
                 run_root: Path | None = None, data_root: Path | None = None, tmpfs_size: str | None = "8g",
                 start_timeout: float = 60.0, lock_timeout: float = 900.0) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{MAX_HOSTS}, not {hosts}")
        self.prefix = prefix
        self.run_root = run_root or Path("/run") / prefix
        self.data_root = data_root or Path("/var/lib") / prefix
        self.managers = hosts if managers is None else managers
        if not 1 <= self.managers <= hosts:
            raise ValueError(f"managers must be 1..{hosts}, not {self.managers}")
        self.runtimes = main_runtimes()
        if runsc_hosts is None:
            runsc_hosts = range(1, hosts + 1) if "runsc" in self.runtimes else ()
        self.runsc_hosts = frozenset(runsc_hosts)
        if self.runsc_hosts and "runsc" not in self.runtimes:
            raise LabError(f"runsc hosts {sorted(self.runsc_hosts)} asked for, but {MAIN_DAEMON_JSON} registers no runsc")
        self.images = tuple(images)
        self.tmpfs_size = tmpfs_size
        self.start_timeout = start_timeout
        self.lock_timeout = lock_timeout
        self.switch_ns = f"{prefix}-sw"
        self.root_veth = f"{prefix}0"
        self.root_ip = str(SWITCH_NET.network_address + 254)
        self.hosts = [
            LabHost(index=i, name=f"{prefix}-h{i}", ip=str(SWITCH_NET.network_address + i),
                    socket=self.run_root / f"h{i}" / "docker.sock", data_root=self.data_root / f"h{i}",
                    exec_root=self.run_root / f"h{i}", runsc=i in self.runsc_hosts)
            for i in range(1, hosts + 1)
        ]
        self.timings: dict[str, float] = {}
        self._daemons: dict[int, subprocess.Popen] = {}
        self._lock: socket.socket | None = None

    # ----- lookups -------------------------------------------------------------------------
    @property
    def shared_snapshots(self) -> Path:
        """The snapshot dir every host mounts at /var/lib/sandkernel/snapshots (shared storage)."""
        return self.data_root / "shared-snapshots"

    def host(self, host: int | LabHost) -> LabHost:
        """The :class:`LabHost` for a 1-based index (or the host itself)."""
        if isinstance(host, LabHost):
            return host
        if not 1 <= host <= len(self.hosts):
            raise ValueError(f"no lab host {host}: the lab has hosts 1..{len(self.hosts)}")
        return self.hosts[host - 1]

    def ip_of(self, host: int | LabHost) -> str:
        """The host's address on the lab network (reachable from the test process)."""
        return self.host(host).ip

    def socket_of(self, host: int | LabHost) -> Path:
        """The unix socket of the host's Docker engine."""
        return self.host(host).socket

    def netns_of(self, host: int | LabHost) -> str:
        """The host's network namespace name (``ip netns exec NAME ...``)."""
        return self.host(host).name

    # ----- commands ------------------------------------------------------------------------
    def docker(self, host: int | LabHost, *args: str, check: bool = True, timeout: float = 60.0,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``docker -H <host's socket> ARGS``; LabError with docker's message if it fails and ``check``."""
        return run(["docker", "-H", self.host(host).docker_host, *args], check=check, timeout=timeout,
                   env=docker_env(), input=input)

    def in_netns(self, host: int | LabHost, *cmd: str, check: bool = True,
                 timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a command inside the host's network namespace."""
        return run(["ip", "netns", "exec", self.netns_of(host), *cmd], check=check, timeout=timeout)

    # ----- lifecycle -----------------------------------------------------------------------
    def up(self) -> Lab:
        """Build the lab: the machine-wide lock, leftovers of a crashed run removed, network,
        engines, swarm, labels, images. On any failure everything is torn down again and
        LabError raised."""
        if Lab._active is not None:
            raise LabError(f"this process already has a lab up ({Lab._active.prefix}): down() it first")
        self._check_prerequisites()
        started = time.monotonic()
        self._take_lock()
        Lab._active = self
        try:
            self._clean()
            network.build(self.switch_ns, [(h.name, h.ip) for h in self.hosts], self.root_veth, self.root_ip,
                          SWITCH_NET)
            self._start_engines()
            self.timings["engines"] = time.monotonic() - started
            self._form_swarm()
            self.timings["swarm"] = time.monotonic() - started
            for image in self.images:
                self.load_image(image)
        except BaseException:
            self.down()
            raise
        self.timings["up"] = time.monotonic() - started
        log.info("lab up in %.1f s: %s", self.timings["up"], ", ".join(f"{h.name}={h.ip}" for h in self.hosts))
        return self

    def down(self) -> None:
        """Tear everything down (idempotent; a no-op unless this object holds the lab): every
        process of the lab SIGKILLed, namespaces, veth, cgroups, mounts, sockets and data roots
        removed, the lock released. LabError if anything is left."""
        if Lab._active is not self:
            return
        started = time.monotonic()
        try:
            self._clean()
        finally:
            Lab._active = None
            if self._lock is not None:
                self._lock.close()
                self._lock = None
        self.timings["down"] = time.monotonic() - started

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _check_prerequisites(self) -> None:
        if os.geteuid() != 0:
            raise LabError("the swarm lab needs root (network namespaces, mounts, its own dockerd)")
        missing = [tool for tool in ("ip", "nsenter", "unshare", "mount", "dockerd", "docker") if shutil.which(tool) is None]
        if missing:
            raise LabError(f"the swarm lab needs {', '.join(missing)} on PATH")

    def _take_lock(self) -> None:
        """Bind the abstract unix socket ``@<prefix>.lab-lock``: one lab per machine. Waits
        (up to ``lock_timeout``) while another process holds it."""
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0{self.prefix}.lab-lock"
        try:
            wait_for(f"the lab lock @{self.prefix}.lab-lock (another test process has a lab up)",
                     lambda: _bind(lock, name), self.lock_timeout, 0.5)
        except BaseException:
            lock.close()
            raise
        self._lock = lock

    # ----- engines -------------------------------------------------------------------------
    def _daemon_command(self, h: LabHost) -> list[str]:
        return [
            "nsenter", f"--net=/run/netns/{h.name}", "--",
            "unshare", "--uts", "--mount", "--propagation", "slave", "--",
            "sh", "-c", _DAEMON_WRAPPER, "sh", h.name, str(h.exec_root), str(h.sandkernel_dir), str(self.shared_snapshots),
            "dockerd",
            "--data-root", str(h.data_root),
            "--exec-root", str(h.exec_root),
            "--pidfile", str(h.exec_root / "dockerd.pid"),
            "-H", h.docker_host,
            "--config-file", str(h.exec_root / "daemon.json"),
            "--cgroup-parent", f"/{h.name}",
            "--exec-opt", "native.cgroupdriver=cgroupfs",
            "--storage-driver", "overlay2",
            "--bip", f"10.213.{10 + h.index}.1/24",
            "--default-address-pool", f"base={BRIDGE_POOL},size=24",
            "--userland-proxy=false",
            "--log-level", "warn",
        ]

    def _start_engine(self, h: LabHost) -> None:
        (h.exec_root / "etc-docker").mkdir(parents=True, exist_ok=True)
        h.data_root.mkdir(parents=True, exist_ok=True)
        config = {"runtimes": {"runsc": self.runtimes["runsc"]}} if h.runsc else {}
        (h.exec_root / "daemon.json").write_text(json.dumps(config, indent=2) + "\n")
        env = docker_env()
        env["DOCKER_SERVICE_PREFER_OFFLINE_IMAGE"] = "1"  # swarm tasks: never try a registry
        with (self.run_root / f"{h.name}.log").open("ab") as out:
            self._daemons[h.index] = subprocess.Popen(
                self._daemon_command(h), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True)

    def _wait_engine(self, h: LabHost) -> None:
        daemon = self._daemons[h.index]

        def answers() -> bool:
            if daemon.poll() is not None:
                raise LabError(f"dockerd of {h.name} exited ({daemon.returncode})")
            return self.docker(h, "version", "--format", "{{.Server.Version}}", check=False,
                               timeout=10).returncode == 0

        try:
            wait_for(f"dockerd of {h.name} to answer on {h.socket}", answers, self.start_timeout)
        except LabError as exc:
            raise LabError(f"{exc}:\n{self.log_tail(h)}") from None
        # In the host's own mount namespace, /run/docker.sock is its engine's socket, as on a real
        # host: a container that binds /var/run/docker.sock (a gateway) reaches this engine, never
        # the machine's main one. The bind lives and dies with the namespace.
        if not Path(HOST_DOCKER_SOCKET).exists():
            raise LabError(f"{HOST_DOCKER_SOCKET} is missing: the lab expects the main engine to run")
        run(["nsenter", f"--target={daemon.pid}", "--mount", "--", "mount", "--bind", str(h.socket),
             HOST_DOCKER_SOCKET])

    def log_tail(self, host: int | LabHost, lines: int = 30) -> str:
        """The end of the host's dockerd log (for error messages)."""
        path = self.run_root / f"{self.host(host).name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _start_engines(self) -> None:
        self.run_root.mkdir(parents=True, exist_ok=True)
        self.data_root.mkdir(parents=True, exist_ok=True)
        if self.tmpfs_size:
            run(["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_size},mode=0700", f"{self.prefix}-data",
                 str(self.data_root)])
        for h in self.hosts:
            self._start_engine(h)
        with ThreadPoolExecutor(len(self.hosts)) as pool:
            list(pool.map(self._wait_engine, self.hosts))
        for h in self.hosts:
            runtimes = self.docker(h, "info", "--format", "{{json .Runtimes}}").stdout
            if h.runsc != ('"runsc"' in runtimes):
                raise LabError(f"{h.name}: runsc registered={not h.runsc}, expected {h.runsc}: {runtimes}")

    # ----- swarm ---------------------------------------------------------------------------
    def _form_swarm(self) -> None:
        first = self.hosts[0]
        self.docker(first, "swarm", "init", "--advertise-addr", first.ip, "--listen-addr", f"{first.ip}:2377",
                    "--default-addr-pool", SWARM_POOL, "--default-addr-pool-mask-length", "24")
        tokens = {role: self.docker(first, "swarm", "join-token", "-q", role).stdout.strip()
                  for role in ("manager", "worker")}
        for h in self.hosts[1:]:  # one at a time: each manager join is a raft membership change
            role = "manager" if h.index <= self.managers else "worker"
            self.docker(h, "swarm", "join", "--token", tokens[role], "--advertise-addr", h.ip,
                        "--listen-addr", f"{h.ip}:2377", f"{first.ip}:2377")
        wait_for(f"{len(self.hosts)} Ready nodes", lambda: len(self.ready_nodes()) == len(self.hosts), 60)
        for h in self.hosts:
            if h.runsc:
                self.docker(first, "node", "update", "--label-add", f"{RUNSC_LABEL}=true", h.name)

    def nodes(self) -> list[dict]:
        """``docker node ls`` as seen from host 1: dicts with Hostname, Status, Availability, ManagerStatus."""
        out = self.docker(1, "node", "ls", "--format", "{{json .}}").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def ready_nodes(self) -> list[str]:
        """Hostnames of the nodes that are Ready."""
        return sorted(n["Hostname"] for n in self.nodes() if n["Status"] == "Ready")

    def node_labels(self, host: int | LabHost) -> dict[str, str]:
        """The swarm node labels of a host."""
        out = self.docker(1, "node", "inspect", self.host(host).name, "--format", "{{json .Spec.Labels}}").stdout
        return json.loads(out) or {}

    def service_tasks(self, service: str) -> list[tuple[str, str]]:
        """(node hostname, state) of the service's tasks meant to run, e.g. ("sklab-h2", "Running")."""
        out = self.docker(1, "service", "ps", service, "--filter", "desired-state=running",
                          "--format", "{{.Node}}\t{{.CurrentState}}").stdout
        return sorted((line.split("\t")[0], line.split("\t")[1].split()[0]) for line in out.splitlines() if line)

    def wait_running(self, service: str, tasks: int, timeout: float = 60.0) -> list[str]:
        """Wait until ``tasks`` tasks of the service are Running; the sorted node hostnames they run on."""
        def running() -> list[str] | None:
            nodes = [node for node, state in self.service_tasks(service) if state == "Running"]
            return sorted(nodes) if len(nodes) >= tasks else None

        return wait_for(f"{tasks} running tasks of service {service}", running, timeout)

    # ----- images --------------------------------------------------------------------------
    def load_image(self, tag: str, timeout: float = 900.0) -> float:
        """Copy ``tag`` from the main engine into every lab engine: ``docker save`` once to a tar
        on the lab's tmpfs, then a ``docker load`` per engine in parallel, then the tar removed;
        returns the seconds taken (also in :attr:`timings`: ``save <tag>``, ``load <tag>``).
        (Streaming one save into the three loads was slower: 12.9 s against 2.3 + 6.5 s for
        the base image, the loads held in step by the pipes.) LabError with docker's message."""
        images = self.data_root / "images"
        images.mkdir(parents=True, exist_ok=True)
        tar = images / (tag.replace("/", "_").replace(":", "_") + ".tar")
        started = time.monotonic()
        try:
            run(["docker", "save", "-o", str(tar), tag], timeout=timeout)
            saved = time.monotonic()
            with ThreadPoolExecutor(len(self.hosts)) as pool:
                list(pool.map(lambda h: self.docker(h, "load", "-q", "-i", str(tar), timeout=timeout), self.hosts))
        finally:
            tar.unlink(missing_ok=True)
        done = time.monotonic()
        self.timings[f"save {tag}"] = saved - started
        self.timings[f"load {tag}"] = done - saved
        return done - started

    def kill_host(self, host: int | LabHost) -> None:
        """The host dies: every process of its engine (dockerd, containerd, shims, containers)
        SIGKILLed and its network link down, so the other hosts see it stop answering. Its
        namespace and files stay until :meth:`down`."""
        h = self.host(host)
        traces.kill_all(lambda: traces.processes([h.name], (f"{h.exec_root}/", f"{h.data_root}/"),
                                                 traces.cgroup_tops(h.name)), 15, self._reap)
        run(["ip", "-n", h.name, "link", "set", "eth0", "down"])

    # ----- teardown ------------------------------------------------------------------------
    def _marks(self) -> tuple[str, str]:
        return f"{self.run_root}/", f"{self.data_root}/"

    def _cgroups(self) -> list[Path]:
        return traces.cgroup_tops(f"{self.prefix}-h*")

    def lab_pids(self) -> set[int]:
        """Every live process of the lab: in one of its network namespaces, in one of its cgroups,
        or whose command line names its directories (dockerd, containerd, shims, runsc, docker load)."""
        return traces.processes(network.named_netns(f"{self.prefix}-"), self._marks(), self._cgroups())

    def lab_mounts(self, *, everywhere: bool = True) -> list[str]:
        """Mount points of the lab (its directories, its netns files) in any mount namespace of
        the machine (or only in this process's with ``everywhere=False``)."""
        return traces.mount_points((str(self.run_root), str(self.data_root), f"/run/netns/{self.prefix}-"),
                                   everywhere=everywhere)

    def _clean(self) -> None:
        """Remove everything of this lab's names, whether this object built it or a crashed run did.

        Every process of the lab is SIGKILLed at once, without a graceful dockerd shutdown: all
        the lab's state is thrown away, every mount its engines made lives in their private mount
        namespaces (gone with their last process), and a graceful stop of three swarm managers
        took over 8 s (each waits for the raft quorum the others are leaving)."""
        phases: dict[str, float] = {}
        mark = time.monotonic()
        traces.kill_all(self.lab_pids, 15, self._reap)
        # Collect each engine this object started: one SIGKILLed after kill_all's last reap would
        # stay our zombie, still "alive" to kill(pid, 0) (seen once in CI: the teardown test).
        for daemon in self._daemons.values():
            daemon.wait(timeout=15)
        self._daemons.clear()
        phases["processes"], mark = time.monotonic() - mark, time.monotonic()
        network.remove(network.named_netns(f"{self.prefix}-"), self.root_veth)
        phases["network"], mark = time.monotonic() - mark, time.monotonic()
        traces.remove_cgroups(self._cgroups())
        for point in reversed(self.lab_mounts(everywhere=False)):  # the data tmpfs, in the root mount ns
            run(["umount", point], check=False)
        for root in (self.run_root, self.data_root):
            if root.exists():
                shutil.rmtree(root)
        phases["files"], mark = time.monotonic() - mark, time.monotonic()
        left = self.leftovers()
        phases["check"] = time.monotonic() - mark
        log.info("lab %s cleaned: %s", self.prefix, ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
        if left:
            raise LabError(f"the lab's teardown left: {left}")

    def _reap(self) -> None:
        for index, daemon in list(self._daemons.items()):
            if daemon.poll() is not None:
                del self._daemons[index]

    def leftovers(self) -> list[str]:
        """What of the lab still exists (empty after a clean down()): namespaces, the root veth,
        processes, mounts (in every mount namespace on the machine), cgroups, directories."""
        left = [f"netns {ns}" for ns in network.named_netns(f"{self.prefix}-")]
        if network.link_exists(self.root_veth):
            left.append(f"link {self.root_veth}")
        left += [f"process {pid}: {traces.cmdline(pid)}" for pid in sorted(self.lab_pids())]
        left += [f"mount {m}" for m in self.lab_mounts()]
        left += [f"cgroup {p}" for p in self._cgroups()]
        left += [f"directory {p}" for p in (self.run_root, self.data_root) if p.exists()]
        return left


def _bind(sock: socket.socket, name: str) -> bool:
    try:
        sock.bind(name)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return False
        raise
    return True


@contextlib.contextmanager
def running_lab(**kwargs) -> Iterator[Lab]:
    """A :class:`Lab` (keyword arguments as its) up for the block and torn down after it; the
    teardown fails loudly (LabError naming what is left) if anything of the lab survives."""
    lab = Lab(**kwargs).up()
    try:
        yield lab
    finally:
        lab.down()


if __name__ == "__main__":  # python -m tests.cluster.lab up|down|leftovers, by hand, for debugging
    import sys

    logging.basicConfig(level=logging.INFO)
    verb = sys.argv[1] if len(sys.argv) > 1 else "leftovers"
    lab = Lab()
    if verb == "up":  # the lab stays up after this process (and its lock) is gone
        lab.up()
    elif verb == "down":  # takes the lock, then removes whatever of the lab exists
        lab._take_lock()
        Lab._active = lab
        lab.down()
    else:
        print("\n".join(lab.leftovers()) or "nothing left")
    if verb != "leftovers":
        print(json.dumps(lab.timings, indent=2))
