"""One hardened kernel container: create it, start kernels in it, kill them, remove it.

The container outlives kernel restarts. Its PID 1 is ``catatonit -P`` (an init in pause mode)
and each kernel is a ``docker exec`` of the image's launcher as the sandbox user. A restart
runs ``kill -KILL -1`` as that user, which ends every process the user's code left behind
(daemons included) but not PID 1, so the container and its /workspace survive: restart keeps
workspace files and drops memory state. Only when that fails (a fork bomb can leave no pid for
the exec) is the whole container replaced. /workspace is the session's disk image (bind-mounted
from the host, see workspace_disk.py), which outlives the container, or with
``workspace_storage: "memory"`` a tmpfs, which goes with it (the caller is told).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import enum
import logging
import re
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker.errors
from docker.types import LogConfig, Ulimit

from sandkernel.blocking import made_or_undone
from sandkernel.errors import HelpersBusyError, KernelStartError, SnapshotError
from sandkernel.kernels.egress.policy import EgressPolicy
from sandkernel.kernels.egress.proxy import CONTAINER_EGRESS_DIR, RELAY_PORT, SOCKET_NAME
from sandkernel.kernels.model.profiles import Profile, Runtime, WorkspaceStorage
from sandkernel.kernels.sandbox.cgroup import container_oom_kills
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, translate_api_error
from sandkernel.kernels.sandbox.exec_stream import SANDBOX_SHELL, SIGKILL_EXIT, Deadline, ExecStreamError, run_helper
from sandkernel.kernels.sandbox.labels import (
    KERNEL_LABEL,
    OWNER_LABEL,
    RUNTIME_DIR_LABEL,
    SESSION_LABEL,
    owner_label,
    process_start_time,
)
from sandkernel.kernels.sandbox.memory_checkpoint import run_runsc_checkpoint, start_from_checkpoint
from sandkernel.kernels.sandbox.runtime_dir import CONNECTION_FILE, CONTAINER_DIR, RuntimeDir
from sandkernel.kernels.sandbox.seccomp import seccomp_security_opt
from sandkernel.kernels.sandbox.state_dir import STATE_DIR_LABEL, state_dir
from sandkernel.kernels.sandbox.thaw import InitWatch
from sandkernel.kernels.sandbox.uids import SANDBOX_UID_RANGE, UID_LABEL

log = logging.getLogger(__name__)

SANDBOX_GID = 10001
WORKSPACE = "/workspace"
WHEELHOUSE = "/wheels"
LAUNCHER = "/opt/sandkernel/launch-kernel"
SUPERVISOR = "/opt/sandkernel/kernel_supervisor.py"  # PID 1 of a savable sandbox
# What the supervisor does on each signal (kernel_supervisor.py's docstring): (re)start the
# kernel, let go of the host sockets before a checkpoint, take the new key and listen again.
SUPERVISOR_START, SUPERVISOR_DETACH, SUPERVISOR_ATTACH = signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP
SUPERVISOR_PROBE_TIMEOUT = 2.0  # seconds for a savable sandbox's relay to accept a liveness probe
# Every process the host starts in the sandbox names image-owned programs by absolute path: the
# tenant writes /workspace, and a name looked up through PATH could resolve to a planted file.
SANDBOX_PYTHON = "/opt/kernel/bin/python"
CONTROL_TIMEOUT = 10.0  # seconds for a signal, the restart's kill or the kernel log (then it is killed)
# Past a helper's deadline, how long its caller still waits for the worker thread to return.
HELPER_ANSWER_SLACK = 2.0
HELPERS_PER_LANE = 2  # helpers one sandbox runs at once in each lane (see SandboxContainer.run_helper)
HELPERS_WAITING = 8  # more may wait in each lane; beyond that a call is refused at once (429)
KILL = "/bin/kill"
# gVisor lets a sandbox's processes signal its PID 1 to death (Linux shields an init): the
# signals the supervisor does not handle stay ignored from the start, across its exec.
IGNORED_BY_SUPERVISOR = "HUP INT QUIT PIPE ALRM TERM USR1 USR2 VTALRM PROF"
SUPERVISOR_ENTRYPOINT = f"trap '' {IGNORED_BY_SUPERVISOR}; exec {SANDBOX_PYTHON} -I {SUPERVISOR}"
SUPERVISOR_READY = "/tmp/.sandkernel/ready"  # the supervisor's handlers are in place (see its docstring)
SUPERVISOR_DETACHED = "/tmp/.sandkernel/detached"  # it has closed every host socket
# Waits for the supervisor to be ready, then signals it (arguments: the signal number). A detach
# also waits for its acknowledgement: a connect to a host socket whose gVisor listener has closed
# hangs rather than being refused, so the host cannot check that from outside. (Not a spin on the
# shell's own test, which saved 30 ms of a pause: a detach that never came would have it burn the
# sandbox's CPU in syscalls until the helper's deadline; bench/README.md, session 21.)
SIGNAL_SUPERVISOR_SCRIPT = (
    f'while [ ! -e {SUPERVISOR_READY} ]; do /bin/sleep 0.02; done; {KILL} "-$1" 1 || exit; '
    f'[ "$1" != {int(signal.SIGUSR2)} ] || while [ ! -e {SUPERVISOR_DETACHED} ]; do /bin/sleep 0.02; done'
)
# Signals the kernel named by its pid file. The file is the sandbox's to write, so its first line
# is only data here and must be a plain pid above 1 (not 0, -1, a list, or a leading zero).
SIGNAL_KERNEL_SCRIPT = (
    'read -r pid < /tmp/kernel.pid || [ -n "$pid" ] || exit 3; case "$pid" in ""|0*|*[!0-9]*|????????*) exit 3;; esac; '
    '[ "$pid" -gt 1 ] || exit 3; exec ' + KILL + ' "$1" "$pid"'
)


class HelperLane(enum.Enum):
    """Which helpers wait for each other: a sandbox's file work, and its control (signals, kills)."""

    CONTROL = "control"
    FILES = "files"


class HelperSlots:
    """At most ``running`` helpers of a lane at once and ``waiting`` more queued behind them;
    beyond that a call is refused at once (a tenant's pile of calls on a sandbox that stops its
    helpers is not kept waiting, each for the ones before it)."""

    def __init__(self, running: int, waiting: int) -> None:
        self._running = asyncio.Semaphore(running)
        self._held = 0
        self.capacity = running + waiting

    @contextlib.asynccontextmanager
    async def held(self, what: str) -> AsyncIterator[None]:
        if self._held >= self.capacity:
            raise HelpersBusyError(
                f"{what} was refused: this session already has {self.capacity} such calls running or waiting; "
                "retry once they have finished"
            )
        self._held += 1
        try:
            async with self._running:
                yield
        finally:
            self._held -= 1


@dataclass(frozen=True)
class ContainerSpec:
    """What a kernel container is made of; the provisioner builds one, tests inspect the result."""

    profile: Profile
    session_id: str
    kernel_id: str
    runtime_dir: RuntimeDir
    uid: int  # the sandbox's own host uid (sandbox_uids.UidAllocator: unique on this host)
    egress_dir: Path | None = None  # the session's egress proxy socket lives here (allowlist policies)
    # The host mount point of the session's workspace disk (workspace_storage "disk"), bound at
    # /workspace; None for a tmpfs workspace.
    workspace_mount: Path | None = None
    # The tenant's CPU group (cpu_groups.cgroup_parent); None: Docker's default place.
    cgroup_parent: str | None = None
    # A sandbox whose memory can be saved (gVisor only): its PID 1 is the kernel supervisor,
    # which starts the kernel and relays its sockets (kernel-image/kernel_supervisor.py).
    savable: bool = False

    @property
    def user(self) -> str:
        """``uid:gid`` for Docker: a uid of this sandbox's own, the image's sandbox group."""
        return f"{self.uid}:{SANDBOX_GID}"

    def create_kwargs(self) -> dict:
        """Keyword arguments for ``containers.create``: every hardening setting in one place."""
        p = self.profile
        mib = 1024 * 1024
        volumes = {str(self.runtime_dir.path): {"bind": CONTAINER_DIR, "mode": "rw"}}
        tmpfs = {"/tmp": f"rw,nosuid,nodev,noexec,size={p.tmp_mb}m,mode=1777"}
        if p.workspace_storage is WorkspaceStorage.DISK:
            if self.workspace_mount is None:
                raise KernelStartError("a disk workspace was asked for but none was mounted for the session")
            # Docker's default bind propagation (rprivate): later host mounts never reach the sandbox.
            volumes[str(self.workspace_mount)] = {"bind": WORKSPACE, "mode": "rw"}
        else:
            tmpfs[WORKSPACE] = f"rw,nosuid,nodev,exec,size={p.workspace_mb}m,uid={self.uid},gid={SANDBOX_GID},mode=0700"
        # No passwd entry exists for the per-sandbox uid: name the user for getpass and friends.
        environment = {"USER": "sandbox", "LOGNAME": "sandbox", **p.env}
        if p.wheelhouse:
            volumes[p.wheelhouse] = {"bind": WHEELHOUSE, "mode": "ro"}
            environment.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=WHEELHOUSE)
        if p.network is not None and self.egress_dir is not None:
            volumes[str(self.egress_dir)] = {"bind": CONTAINER_EGRESS_DIR, "mode": "ro"}
            environment.update(egress_environment(p.network))
            if p.network.ca_bundle:
                volumes[p.network.ca_bundle] = {"bind": CA_BUNDLE, "mode": "ro"}
        placement = {"cgroup_parent": self.cgroup_parent} if self.cgroup_parent else {}
        if self.savable:
            if p.runtime is not Runtime.RUNSC:
                raise KernelStartError("only gVisor (runtime runsc) sandboxes can have their memory saved")
            placement["entrypoint"] = [SANDBOX_SHELL, "-c", SUPERVISOR_ENTRYPOINT]
        return {
            **placement,
            "image": p.image,
            "name": f"sandkernel-{self.session_id[:12]}-{secrets.token_hex(3)}",
            "hostname": "sandbox",
            "user": self.user,
            "working_dir": WORKSPACE,
            "environment": environment,
            "runtime": p.runtime.value,
            "network_mode": "none",
            "read_only": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges:true", seccomp_security_opt()],
            "ipc_mode": "private",
            "tmpfs": tmpfs,
            "volumes": volumes,
            "mem_limit": p.memory_mb * mib,
            "memswap_limit": p.memory_mb * mib,  # equal to the memory limit: no swap
            "nano_cpus": int(p.cpus * 1e9),
            "pids_limit": host_pids_limit(p),
            "ulimits": [
                Ulimit(name="nofile", soft=p.nofile, hard=p.nofile),
                Ulimit(name="core", soft=0, hard=0),
                Ulimit(name="fsize", soft=p.fsize_mb * mib, hard=p.fsize_mb * mib),
            ],
            "log_config": LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"}),
            "labels": {
                SESSION_LABEL: self.session_id,
                KERNEL_LABEL: self.kernel_id,
                OWNER_LABEL: owner_label(),
                RUNTIME_DIR_LABEL: str(self.runtime_dir.path),
                "sandkernel.profile": p.name,
                UID_LABEL: str(self.uid),
                STATE_DIR_LABEL: str(state_dir()),
            },
            "detach": True,
        }


CA_BUNDLE = "/etc/sandkernel/ca-bundle.pem"


def egress_environment(policy: EgressPolicy) -> dict[str, str]:
    """What makes ordinary tools (pip, requests, urllib, curl) use the egress relay."""
    proxy = f"http://127.0.0.1:{RELAY_PORT}"
    env = {
        "SANDKERNEL_EGRESS_SOCKET": f"{CONTAINER_EGRESS_DIR}/{SOCKET_NAME}",
        "HTTP_PROXY": proxy,
        "HTTPS_PROXY": proxy,
        "http_proxy": proxy,
        "https_proxy": proxy,
        "NO_PROXY": "localhost,127.0.0.1",
        "no_proxy": "localhost,127.0.0.1",
    }
    if policy.ca_bundle:
        env.update(SSL_CERT_FILE=CA_BUNDLE, REQUESTS_CA_BUNDLE=CA_BUNDLE, PIP_CERT=CA_BUNDLE, CURL_CA_BUNDLE=CA_BUNDLE)
    return env


def host_pids_limit(profile: Profile) -> int:
    """The cgroup pids limit for the container.

    Under runc it is the profile's limit on the sandbox's processes and threads. Under gVisor
    the cgroup holds the sandbox's own host threads (sentry, gofer, ptrace stubs) rather than
    the guest's tasks, so the same number would starve gVisor itself; it gets headroom, and
    a guest that still exhausts it ends the sandbox (reported as kernel_died), never the host.
    """
    if profile.runtime is Runtime.RUNSC:
        return max(profile.pids * 4, 512)
    return profile.pids


class SandboxContainer:
    """A running kernel container and the kernel process (an exec) inside it."""

    def __init__(self, engine: DockerEngine, container_id: str, spec: ContainerSpec) -> None:
        self.engine = engine
        self.id = container_id
        self.spec = spec
        self.user = spec.user
        self.exec_id: str | None = None
        self._host_process: tuple[int, str] | None = None
        # Helpers at once, per lane: a sandbox whose code stops its helpers holds this many of
        # the engine's worker threads at most, each until its deadline. Control (signals, the
        # restart's kill) has a lane of its own, so a stuck file helper never delays a restart.
        self._lanes = {lane: HelperSlots(HELPERS_PER_LANE, HELPERS_WAITING) for lane in HelperLane}
        self.init_watch = InitWatch(self.id)  # while helpers run: execs the sandbox stopped are killed

    @classmethod
    async def start(cls, engine: DockerEngine, spec: ContainerSpec) -> SandboxContainer:
        """Create and start the container (blocking work in a thread). Removes it if start fails."""
        kwargs = spec.create_kwargs()

        def create_and_start() -> str:
            try:
                container = engine.client.containers.create(**kwargs)
            except docker.errors.APIError as err:
                raise translate_api_error(err, f"cannot create a {spec.profile.runtime.value} container") from err
            try:
                container.start()
            except docker.errors.APIError as err:
                container.remove(force=True)
                raise translate_api_error(err, "cannot start the kernel container") from err
            return container.id

        async def remove(container_id: str) -> None:
            await engine.run(engine.client.api.remove_container, container_id, force=True)

        container_id = await made_or_undone(engine.run(create_and_start), remove)
        log.info("container started", extra={"session": spec.session_id, "container": container_id[:12]})
        return cls(engine, container_id, spec)

    @classmethod
    async def start_from_memory(cls, engine: DockerEngine, spec: ContainerSpec, image_dir: Path) -> SandboxContainer:
        """Create a savable container from ``spec`` and start it from the memory checkpoint in
        ``image_dir`` (see memory_checkpoint.py). Its kernel runs on, detached: prepare the
        runtime dir with the new key, then :meth:`attach_kernel`. Removed if the start fails."""
        if not spec.savable:
            raise KernelStartError("only a savable sandbox can start from a memory checkpoint")
        kwargs = spec.create_kwargs()

        def create() -> str:
            try:
                return engine.client.containers.create(**kwargs).id
            except docker.errors.APIError as err:
                raise translate_api_error(err, "cannot create the container for a memory checkpoint") from err

        async def remove(container_id: str) -> None:
            await engine.run(engine.client.api.remove_container, container_id, force=True)

        container_id = await engine.run(create)
        await made_or_undone(start_from_checkpoint(engine, container_id, image_dir), lambda _: remove(container_id))
        log.info("container restored", extra={"session": spec.session_id, "container": container_id[:12]})
        return cls(engine, container_id, spec)

    async def save_memory(self, image_dir: Path, *, leave_running: bool = False) -> None:
        """Write the sandbox's memory to ``image_dir`` (which must not exist yet). The container
        ends with it (its kernel goes on only in a container started from the image) unless
        ``leave_running``: then its kernel goes on, detached until :meth:`attach_kernel`."""
        if not self.spec.savable:
            raise SnapshotError("this sandbox was not started savable; its memory cannot be saved")
        runsc = await self.engine.run(lambda: self.engine.client.info()["Runtimes"]["runsc"]["path"])
        await self.signal_supervisor(SUPERVISOR_DETACH)
        await asyncio.to_thread(self.spec.runtime_dir.remove_sockets)
        await run_runsc_checkpoint(runsc, self.id, image_dir, leave_running=leave_running)
        if not leave_running:
            self.exec_id = None

    async def attach_kernel(self) -> None:
        """Have a restored kernel take the key of the runtime dir's connection file and listen
        on its sockets again (prepare the dir first; then wait for the sockets as at a start).

        The signal goes through the engine (runsc's kill, to the sandbox's PID 1), not through a
        helper exec: 35 ms against 120-400 ms for the exec and its shell here, once per resume,
        fork child and fork parent. That needs no wait for the supervisor's handlers, which an
        exec'd helper checks first: a kernel to attach was saved (a restore) or detached (a
        fork's parent) by a supervisor whose handlers were in place, and the sockets appearing is
        the answer the caller waits for."""
        try:
            await self.engine.run(self.engine.client.api.kill, self.id, int(SUPERVISOR_ATTACH))
        except docker.errors.APIError as err:
            raise translate_api_error(err, "cannot signal the sandbox's kernel supervisor") from err
        self.exec_id = SUPERVISOR

    @property
    def host_process(self) -> tuple[int, str] | None:
        """The kernel exec's host pid and start time (recorded so a later process can check it)."""
        return self._host_process

    def recall_host_process(self, recorded: object) -> None:
        """Take back a recorded :attr:`host_process` (re-adoption); anything else is ignored and
        liveness falls back to asking Docker."""
        if isinstance(recorded, (list, tuple)) and len(recorded) == 2:
            pid, start = recorded
            if isinstance(pid, int) and not isinstance(pid, bool) and isinstance(start, str):
                self._host_process = (pid, start)

    # -- kernel process -------------------------------------------------------------------

    async def exec_kernel(self) -> None:
        """Start the kernel (the image's launcher) as the sandbox user, detached. In a savable
        sandbox the kernel must descend from PID 1 (gVisor's restore kills exec'd processes):
        the supervisor starts it."""
        if self.spec.savable:
            await self.signal_supervisor(SUPERVISOR_START)
            self.exec_id = SUPERVISOR
            return
        api = self.engine.client.api

        def start() -> str:
            exec_id = api.exec_create(
                self.id,
                [LAUNCHER, f"{CONTAINER_DIR}/{CONNECTION_FILE}"],
                user=self.user,
                workdir=WORKSPACE,
            )["Id"]
            api.exec_start(exec_id, detach=True)
            return exec_id

        try:
            self.exec_id = await self.engine.run(start)
            state = await self.engine.run(api.exec_inspect, self.exec_id)
        except docker.errors.APIError as err:
            raise translate_api_error(err, "cannot start the kernel process") from err
        # The exec's host process (runc: the kernel; runsc: its `runsc exec`) lets liveness be
        # checked in /proc instead of a Docker API call on every execute.
        pid = int(state.get("Pid") or 0)
        start_time = process_start_time(pid) if pid else None
        self._host_process = (pid, start_time) if start_time else None

    async def signal_supervisor(self, signum: int) -> None:
        """Send ``signum`` to a savable sandbox's PID 1 (what each means: SUPERVISOR_*)."""
        code, text = await self.run_as_sandbox([SANDBOX_SHELL, "-c", SIGNAL_SUPERVISOR_SCRIPT, "sh", str(int(signum))])
        if code != 0:
            raise KernelStartError(f"cannot signal the sandbox's kernel supervisor: {text.strip() or code}")

    async def kernel_exit_code(self) -> int | None:
        """None while the kernel process runs, else its exit code (-1 if the container is gone)."""
        if self.exec_id is None:
            return -1
        if self.spec.savable:
            return await self._supervised_kernel_exit_code()
        if self._host_process and process_start_time(self._host_process[0]) == self._host_process[1]:
            return None
        try:
            state = await self.engine.run(self.engine.client.api.exec_inspect, self.exec_id)
        except docker.errors.APIError:
            return -1
        if state.get("Running"):
            # dockerd, behind on a loaded host, still says it runs: a recorded host process that
            # is gone or a zombie says otherwise (its code is not known yet). Believing dockerd,
            # a cell was sent to a kernel the OOM killer had already ended, and was lost with it.
            return -1 if self._host_process else None
        code = state.get("ExitCode")
        return -1 if code is None else int(code)

    async def _supervised_kernel_exit_code(self) -> int | None:
        """A savable sandbox's kernel is not a process the host can see (a gVisor guest, not an
        exec). Its heartbeat socket tells: the supervisor relays a connection to the kernel, whose
        ZMQ greets first, or closes it at once when the kernel is gone. No answer in time (a
        loaded host, a stopped kernel) counts as alive, as a process that exists is; no socket file
        (a start in progress, a detach for a checkpoint) too: the start's and the checkpoint's
        own deadlines bound those."""
        heartbeat = self.spec.runtime_dir.socket_paths()[-1]
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(heartbeat)), SUPERVISOR_PROBE_TIMEOUT
            )
        except (asyncio.TimeoutError, FileNotFoundError):  # not listening: a detach, a start
            return None
        except OSError:
            return -1
        try:
            greeting = await asyncio.wait_for(reader.read(1), SUPERVISOR_PROBE_TIMEOUT)
        except asyncio.TimeoutError:
            return None
        except OSError:
            return -1
        finally:
            writer.close()
        return None if greeting else -1

    async def run_as_sandbox(
        self, argv: list[str], timeout: float = CONTROL_TIMEOUT, *, hold: bool = True
    ) -> tuple[int, str]:
        """Run a short command inside the sandbox as the sandbox user (never as root): its exit
        code and its stdout and stderr. ExecStreamError past ``timeout`` (it is killed). ``hold``:
        see :func:`exec_stream.run_helper`."""
        code, stdout, stderr = await self.run_helper(argv, timeout, what=f"the sandbox helper {argv[0]}", hold=hold)
        return code, (stdout + stderr).decode(errors="replace")

    async def run_helper(
        self,
        argv: list[str],
        timeout: float,
        *,
        what: str,
        lane: HelperLane = HelperLane.CONTROL,
        stdin: bytes | None = None,
        workdir: str | None = None,
        max_output: int = 64 * 1024 * 1024,
        hold: bool = True,
    ) -> tuple[int, bytes, bytes]:
        """Run ``argv`` as the sandbox user within ``timeout`` seconds, in ``lane`` (at most
        HELPERS_PER_LANE at once): (exit code, stdout, stderr). ExecStreamError (504) when it
        does not finish in time, its output is too large or its stream breaks; a cancelled
        caller ends it at its next read."""
        deadline = Deadline(timeout)
        api = self.engine.client.api
        async with self._lanes[lane].held(what), self.init_watch.during():
            work = self.engine.run(
                run_helper,
                api,
                self.id,
                self.user,
                argv,
                deadline,
                what,
                stdin=stdin,
                workdir=workdir,
                max_output=max_output,
                hold=hold,
            )
            try:
                # The thread reads with the deadline; a Docker call that does not answer (dockerd
                # waiting on the container) is not waited for past it: its thread ends when dockerd
                # answers or the client's timeout passes.
                return await asyncio.wait_for(work, timeout + HELPER_ANSWER_SLACK)
            except asyncio.TimeoutError:
                deadline.stop.set()
                raise ExecStreamError(f"{what} did not finish within its {timeout:g} s limit") from None
            except asyncio.CancelledError:
                deadline.stop.set()
                raise

    async def signal_kernel(self, signum: int) -> None:
        """Send a signal to the kernel process (its pid file is in the sandbox's /tmp).

        A pid file that is not a single pid above 1 is refused (logged, nothing signalled): the
        restart ladder, not a guess, deals with a kernel whose pid file was tampered with."""
        code, _ = await self.run_as_sandbox([SANDBOX_SHELL, "-c", SIGNAL_KERNEL_SCRIPT, "sh", f"-{int(signum)}"])
        if code == 3:
            log.warning("kernel pid file is not a pid; signal %d not sent", signum, extra={"container": self.id[:12]})

    async def kill_sandbox_processes(self) -> bool:
        """SIGKILL every process of the sandbox user but PID 1. False if that could not run."""
        try:
            code, _ = await self.run_as_sandbox([KILL, "-KILL", "-1"], hold=False)  # it would kill its holder
        except (docker.errors.APIError, ExecStreamError) as err:
            log.warning("kill -1 in sandbox failed: %s", err, extra={"container": self.id[:12]})
            return False
        # kill(-1) reports ESRCH (exit 1) when there was nothing left to kill: still a success.
        return code in (0, 1)

    async def kernel_log(self) -> str:
        """The kernel's own stdout/stderr (for start-failure messages)."""
        try:
            # timeout: the sandbox could have made the log a FIFO that never ends.
            _, text = await self.run_as_sandbox(
                [SANDBOX_SHELL, "-c", "exec /usr/bin/timeout 5 /usr/bin/tail -c 4000 /tmp/kernel.log 2>/dev/null"]
            )
        except (docker.errors.APIError, ExecStreamError):
            return ""
        return text

    # -- container ------------------------------------------------------------------------

    async def engine_state(self) -> dict | None:
        """The engine's ``State`` of the container (Running, OOMKilled, ExitCode...); None if gone."""
        try:
            attrs = await self.engine.run(self.engine.client.api.inspect_container, self.id)
        except docker.errors.APIError:
            return None
        return attrs.get("State") or {}

    async def is_running(self) -> bool:
        state = await self.engine_state()
        return bool(state and state.get("Running"))

    async def oom_killed(self) -> bool:
        """Whether the engine saw the container itself killed for memory (gVisor's whole sandbox
        dies that way; under runc only the kernel process is killed, see :meth:`oom_kill_count`)."""
        state = await self.engine_state()
        return bool(state and not state.get("Running") and state.get("OOMKilled"))

    async def killed_for_memory(self, state: dict[str, Any], grace: float) -> bool:
        """See :func:`killed_for_memory`."""
        return await killed_for_memory(self.engine, self.id, state, grace)

    async def oom_kill_count(self) -> int | None:
        """How many processes the memory cgroup's OOM killer has ended in this container."""
        return await asyncio.to_thread(container_oom_kills, self.id)

    async def stop_hard(self) -> None:
        """Kill the whole container (last step of the ladder); it stays until :meth:`remove`."""
        try:
            await self.engine.run(self.engine.client.api.kill, self.id, signal.SIGKILL)
        except docker.errors.APIError as err:
            log.debug("kill container: %s", err)

    async def remove(self) -> None:
        """Force-remove the container; safe to call twice. (An exec the sandbox stopped would
        hold the removal in dockerd: the init watch ends it.)"""
        try:
            async with self.init_watch.during():
                await self.engine.run(self.engine.client.api.remove_container, self.id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as err:
            if "already in progress" not in str(err):
                raise
        log.info("container removed", extra={"container": self.id[:12]})


async def oom_event_logged(engine: DockerEngine, container_id: str, started_at: str, grace: float) -> bool:
    """Whether the engine logged an ``oom`` event for the container since it started.

    Docker's ``OOMKilled`` is set only when the runtime's OOM event comes before its exit
    event; gVisor's shim may send them the other way round on a loaded host, and the stop is
    then recorded as a plain exit 137 though the ``oom`` event is still logged. The events
    are read up to ``grace`` seconds from now (an OOM event may follow the exit), and the
    stream ends at the first match or at that deadline. Best effort: dockerd keeps only its
    last 256 events, which a busy host can pass before this looks (two parallel rehearsals
    found no event for a real OOM this way)."""
    try:
        since = int(parse_engine_time(started_at)) - 1
    except ValueError:  # no start recorded: the engine keeps a short history, read all of it
        since = 0
    until = int(time.time() + grace) + 1
    filters = {"container": container_id, "event": "oom"}

    def scan() -> bool:
        stream = engine.client.events(since=since, until=until, filters=filters, decode=True)
        try:
            return next(iter(stream), None) is not None
        finally:
            stream.close()

    try:
        return await engine.run(scan)
    except docker.errors.APIError as err:
        log.debug("read oom events: %s", err)
        return False


async def killed_for_memory(engine: DockerEngine, container_id: str, state: dict[str, Any], grace: float) -> bool:
    """Whether a container that stopped (its engine ``state``) was killed for memory: Docker's
    ``OOMKilled``, or a SIGKILL's exit code with the engine's ``oom`` event logged (the order
    of the two events decides the flag, see :func:`oom_event_logged`)."""
    if state.get("OOMKilled"):
        return True
    return state.get("ExitCode") == SIGKILL_EXIT and await oom_event_logged(
        engine, container_id, str(state.get("StartedAt") or ""), grace
    )


def parse_engine_time(stamp: str) -> float:
    """Seconds since the epoch of an engine timestamp (RFC 3339 with nanoseconds, ``Z``)."""
    whole = re.sub(r"\.\d+", "", stamp).replace("Z", "+00:00")
    return dt.datetime.fromisoformat(whole).timestamp()


async def wait_until(predicate, timeout: float, interval: float = 0.01) -> bool:
    """Poll a cheap (sync or async) predicate until true or the timeout; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result or time.monotonic() >= deadline:
            return bool(result)
        await asyncio.sleep(interval)


__all__ = ["SANDBOX_UID_RANGE", "ContainerSpec", "KernelStartError", "SandboxContainer", "wait_until"]
