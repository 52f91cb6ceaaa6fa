"""``sandkernel-docker``: a jupyter_client kernel provisioner that runs each kernel in a sandbox.

Any Jupyter tool that starts kernels by name (jupyter_client, nbclient, jupyter_server,
JupyterLab) gets a hardened container per kernel through this class. It follows
``KernelProvisionerBase``'s lifecycle exactly: pre_launch → launch_kernel → poll/wait →
send_signal/terminate/kill → cleanup. The kernel talks ZMQ over ipc sockets in a host runtime
dir (see runtime_dir.py), so no port is ever published and the container has no network.

Extra keyword arguments a caller may pass to ``KernelManager.start_kernel``:
``sandkernel_profile`` (profile name), ``sandkernel_overrides`` (mapping of profile settings),
``sandkernel_session_id`` (label value; defaults to the kernel id), ``sandkernel_workspace``
(what :meth:`DockerProvisioner.hand_over_workspace` returned: the session's disk and uid, kept
when the whole kernel manager is replaced), ``sandkernel_cpu_group`` (the tenant's CPU group,
from cpu_groups.group_for), ``sandkernel_savable`` (gVisor only: a sandbox whose memory
:meth:`DockerProvisioner.save_memory` can write out) and ``sandkernel_restore_from`` (a directory
that method wrote: the first launch starts a savable sandbox from it, the kernel running on with
this manager's new key, instead of a fresh kernel) with ``sandkernel_restore_uid`` (the uid the
saved kernel runs as: its processes keep their credentials through the restore), and
``sandkernel_workspace_image`` (a workspace image a pause kept whole, checked and copied for
this session: the first container's /workspace disk, moved into place instead of a fresh one).
The host environment is never forwarded into the container: only ``Profile.env`` is.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import time
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import KernelProvisionerBase
from traitlets import Unicode

from sandkernel.blocking import made_or_undone
from sandkernel.errors import AdoptionRefusedError, ConfigError, KernelStartError, SnapshotError
from sandkernel.kernels.egress.proxy import EgressProxy
from sandkernel.kernels.model.profiles import Profile, Runtime, WorkspaceStorage, resolve_profile
from sandkernel.kernels.sandbox.container import LAUNCHER, SANDBOX_GID, ContainerSpec, SandboxContainer
from sandkernel.kernels.sandbox.cpu_groups import GROUP_NAME, cgroup_parent
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import owner_label
from sandkernel.kernels.sandbox.runtime_dir import CONNECTION_FILE, CONTAINER_DIR, PORTS, RuntimeDir
from sandkernel.kernels.sandbox.uids import SANDBOX_UID_RANGE, UidAllocator
from sandkernel.kernels.sandbox.workspace_disk import WorkspaceDisk, disk_support

EXEC_POLL_INTERVAL = 0.25
log = logging.getLogger(__name__)


class DockerProvisioner(KernelProvisionerBase):
    """Launches an IPython kernel inside a locked-down Docker container (runc or gVisor)."""

    profile_name = Unicode("default", config=True, help="Name of the sandkernel profile (limits, runtime, image).")
    runtime = Unicode("", config=True, help="'runc' or 'runsc' (gVisor); empty means the profile's runtime.")

    container: SandboxContainer | None = None
    runtime_dir: RuntimeDir | None = None
    egress: EgressProxy | None = None
    profile: Profile | None = None
    session_id: str = ""
    image_id: str = ""
    uid: int | None = None  # the sandbox's host uid, reserved until _release
    # The session's /workspace disk (workspace_storage "disk"), made before the first container
    # and kept until _release: a replaced container gets the same one.
    workspace_disk: WorkspaceDisk | None = None
    # The tenant's CPU group (cpu_groups.py), given at the first launch and kept for replacements.
    cpu_group: str | None = None
    savable: bool = False  # the sandbox's PID 1 is the kernel supervisor (memory snapshots)
    restore_from: Path | None = None  # the memory checkpoint the first launch starts from
    restore_uid: int | None = None  # the uid that checkpoint's kernel runs as
    # A workspace image kept whole by a pause (WorkspaceDisk.release_image), checked and copied
    # for this session: the first container's disk instead of a fresh one.
    workspace_image: Path | None = None
    # Set when the last (re)launch had to replace the whole container.
    container_replaced: bool = False
    # Set when /workspace went with the replaced container (a tmpfs workspace); a disk workspace
    # survives the replacement, so it stays False.
    workspace_lost: bool = False

    @property
    def has_process(self) -> bool:
        return self.container is not None and self.container.exec_id is not None

    # -- launch ---------------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Validate the profile, runtime and image before anything is created, then write
        the host-side connection file (ipc transport, sockets in the runtime dir)."""
        profile_name = kwargs.pop("sandkernel_profile", None) or self.profile_name
        overrides = dict(kwargs.pop("sandkernel_overrides", None) or {})
        session_id = kwargs.pop("sandkernel_session_id", None)
        handed_over = kwargs.pop("sandkernel_workspace", None)
        cpu_group = kwargs.pop("sandkernel_cpu_group", None)
        restore_from = kwargs.pop("sandkernel_restore_from", None)
        restore_uid = kwargs.pop("sandkernel_restore_uid", None)
        workspace_image = kwargs.pop("sandkernel_workspace_image", None)
        savable = bool(kwargs.pop("sandkernel_savable", False) or restore_from)
        if self.profile is None:
            if self.runtime:
                overrides.setdefault("runtime", self.runtime)
            profile = resolve_profile(profile_name, overrides)
            if profile.workspace_storage is WorkspaceStorage.DISK:
                supported, why = await asyncio.to_thread(disk_support)
                if not supported:
                    raise ConfigError(f"cannot give this session a disk workspace: {why}")
            engine = default_engine()
            await engine.require_runtime(profile.runtime.value)
            self.image_id = await engine.image_id(profile.image)
            self.profile = profile
            self.session_id = str(session_id or self.kernel_id)
            if cpu_group is not None and not GROUP_NAME.fullmatch(str(cpu_group)):
                raise ConfigError(f"sandkernel_cpu_group must be a name cpu_groups.group_for made, not {cpu_group!r}")
            self.cpu_group = cpu_group
            if savable and profile.runtime is not Runtime.RUNSC:
                raise ConfigError("memory snapshots need gVisor: a savable sandbox must use runtime 'runsc'")
            if savable and profile.network is not None:
                raise ConfigError("a sandbox with network egress cannot be savable yet (its relay holds a host socket)")
            self.savable = savable
            self.restore_from = Path(restore_from) if restore_from else None
            if restore_uid is not None:
                low, high = SANDBOX_UID_RANGE
                if isinstance(restore_uid, bool) or not isinstance(restore_uid, int) or not low <= restore_uid < high:
                    raise ConfigError(f"sandkernel_restore_uid must be a sandbox uid ({low} to {high - 1})")
                if handed_over is None:
                    self.restore_uid = restore_uid
            if handed_over is not None:
                await self._take_over_workspace(handed_over)
            elif workspace_image is not None:
                if profile.workspace_storage is not WorkspaceStorage.DISK:
                    raise ConfigError("a saved workspace image needs a session with workspace_storage 'disk'")
                self.workspace_image = Path(workspace_image)
            self.runtime_dir = await asyncio.to_thread(RuntimeDir.create)
            if profile.network is not None:  # allowlist: the session's proxy, before any container
                self.egress = EgressProxy(profile.network, self.session_id, self.runtime_dir.egress_dir)
                await self.egress.start()

        km = self.parent
        km.transport = "ipc"
        km.ip = self.runtime_dir.host_ip
        for name, port in PORTS.items():
            setattr(km, name, port)
        km.write_connection_file()
        self.connection_info = km.get_connection_info()
        kwargs = await super().pre_launch(cmd=[LAUNCHER, f"{CONTAINER_DIR}/{CONNECTION_FILE}"], **kwargs)
        kwargs.pop("env", None)  # the host environment never enters the sandbox
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start (or reuse) the container, exec the kernel, wait for its sockets, lock them."""
        assert self.profile is not None and self.runtime_dir is not None
        first_launch = self.container is None
        self.container_replaced = self.workspace_lost = False  # what this launch did, for the caller
        try:
            if self.container is not None and not await self.container.is_running():
                await self.container.remove()
                self.container = None
                self._note_replacement()
            restoring = self.container is None and self.restore_from is not None
            if self.container is None:
                await self._start_container()
            key = self.connection_info["key"]
            info = dict(self.connection_info, key=key.decode() if isinstance(key, bytes) else key)
            try:
                await asyncio.to_thread(self.runtime_dir.prepare, info, SANDBOX_GID)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT) or first_launch:
                    raise
                # The runtime dir's tmpfs is full: under gVisor, files a killed kernel filled stay
                # held by its sandbox's cached host handles until the container goes. Replace it.
                log.warning("runtime dir full; replacing the container", extra={"session": self.session_id})
                await self.container.remove()
                self.container = None
                self._note_replacement()
                await self._start_container()
                await asyncio.to_thread(self.runtime_dir.prepare, info, SANDBOX_GID)
            if restoring:
                self.restore_from = None  # a later restart starts a fresh kernel
                await self.container.attach_kernel()
            else:
                await self.container.exec_kernel()
            await self._wait_for_sockets()
            await asyncio.to_thread(self.runtime_dir.lock)
        except BaseException:
            if first_launch:
                await self._release()
            raise
        return self.connection_info

    def _note_replacement(self) -> None:
        self.container_replaced = True
        self.workspace_lost = self.workspace_disk is None

    async def _start_container(self) -> None:
        """Create and start the session's container (its uid and workspace disk are kept if it
        is a replacement). The disk is made and mounted on the host before the container exists,
        so the bind mount finds it (mounts made later would not propagate into the sandbox)."""
        assert self.profile is not None and self.runtime_dir is not None
        egress_dir = self.egress.directory if self.egress else None
        if self.uid is None and self.restore_uid is not None:
            # A saved kernel keeps its uid through the restore. Under gVisor a uid is no host
            # process's (the kernel's accounting it buys under runc does not apply), so another
            # sandbox that took it meanwhile, or a fork's siblings, share it harmlessly.
            allocator = UidAllocator(default_engine())
            await asyncio.to_thread(allocator.claim, self.restore_uid)
            self.uid = self.restore_uid
        if self.uid is None:  # kept when the container is replaced: one uid per session
            allocator = UidAllocator(default_engine())
            self.uid = await made_or_undone(
                asyncio.to_thread(allocator.allocate), lambda uid: asyncio.to_thread(allocator.release, uid)
            )
        mount = None
        if self.profile.workspace_storage is WorkspaceStorage.DISK:
            if self.workspace_disk is None:
                size, owner = self.profile.workspace_mb, owner_label()
                image, self.workspace_image = self.workspace_image, None  # the first container's only
                if image is not None:
                    made = asyncio.to_thread(
                        WorkspaceDisk.from_image, self.session_id, image, size, self.uid, SANDBOX_GID, owner
                    )
                else:
                    made = asyncio.to_thread(WorkspaceDisk.create, self.session_id, size, self.uid, SANDBOX_GID, owner)
                self.workspace_disk = await made_or_undone(made, lambda disk: asyncio.to_thread(disk.remove))
            else:
                await asyncio.to_thread(self.workspace_disk.ensure_mounted)
            mount = self.workspace_disk.mount_point
        engine = default_engine()
        driver = await engine.run(engine.cgroup_driver_sync) if self.cpu_group else ""
        spec = ContainerSpec(
            self.profile,
            self.session_id,
            str(self.kernel_id),
            self.runtime_dir,
            self.uid,
            egress_dir,
            mount,
            cgroup_parent(self.cpu_group, driver),
            savable=self.savable,
        )
        if self.restore_from is not None:
            self.container = await SandboxContainer.start_from_memory(engine, spec, self.restore_from)
        else:
            self.container = await SandboxContainer.start(engine, spec)

    async def _take_over_workspace(self, handed_over: Any) -> None:
        """Adopt the disk and uid a previous provisioner of this session handed over (see
        :meth:`hand_over_workspace`); they must be this session's and match the profile."""
        assert self.profile is not None
        if not isinstance(handed_over, dict) or not isinstance(handed_over.get("uid"), int):
            raise AdoptionRefusedError("sandkernel_workspace must be what hand_over_workspace() returned")
        disk = WorkspaceDisk.from_dict(handed_over.get("disk"))
        if disk.session_id != self.session_id or disk.uid != handed_over["uid"]:
            raise AdoptionRefusedError(f"the workspace handed over is not session {self.session_id}'s")
        # This session's from here on: if anything below fails, _release removes them.
        self.uid, self.workspace_disk = handed_over["uid"], disk
        if self.profile.workspace_storage is not WorkspaceStorage.DISK:
            raise AdoptionRefusedError("a disk workspace was handed over to a session with a memory workspace")
        await asyncio.to_thread(disk.ensure_mounted)

    def hand_over_workspace(self) -> dict[str, Any] | None:
        """Keep the disk workspace (and the uid that owns its files) for the next provisioner
        of this session, when the whole kernel manager is replaced (the ladder's last rung):
        cleanup then leaves both alone. Pass the result as ``sandkernel_workspace`` to the next
        ``start_kernel``. None for a tmpfs workspace: nothing survives the container."""
        if self.workspace_disk is None or self.uid is None:
            return None
        handed = {"disk": self.workspace_disk.to_dict(), "uid": self.uid}
        self.workspace_disk = None
        self.uid = None  # the reservation stays: the next provisioner of this process takes it
        return handed

    def detach_workspace_disk(self) -> WorkspaceDisk | None:
        """Take the disk workspace out of this provisioner's hands: cleanup leaves it (mounted)
        for the caller, who keeps it whole (a pause: WorkspaceDisk.release_image) or removes it.
        None for a tmpfs workspace. The uid stays reserved until cleanup, as usual."""
        disk, self.workspace_disk = self.workspace_disk, None
        return disk

    async def _wait_for_sockets(self) -> None:
        assert self.container is not None and self.runtime_dir is not None and self.profile is not None
        deadline = time.monotonic() + self.profile.start_timeout
        next_exec_check = time.monotonic() + EXEC_POLL_INTERVAL
        while not self.runtime_dir.sockets_ready():
            now = time.monotonic()
            if now >= deadline:
                raise KernelStartError(
                    f"the kernel did not bind its sockets within {self.profile.start_timeout:g}s; "
                    f"kernel log: {await self.container.kernel_log() or '(empty)'}"
                )
            if now >= next_exec_check:
                next_exec_check = now + EXEC_POLL_INTERVAL
                code = await self.container.kernel_exit_code()
                if code is not None:
                    raise KernelStartError(
                        f"the kernel process exited with code {code} during start-up; "
                        f"kernel log: {await self.container.kernel_log() or '(empty)'}"
                    )
            await asyncio.sleep(0.005)

    async def save_memory(self, image_dir: Path, *, leave_running: bool = False) -> None:
        """Write the savable sandbox's memory to ``image_dir`` (a new directory). The container
        ends with it (the workspace disk and runtime dir stay until cleanup) unless
        ``leave_running`` (a fork's parent): then its kernel listens again, with the same key,
        once the image is written. Start another provisioner with ``sandkernel_restore_from``
        to carry on from the image."""
        if self.container is None or self.runtime_dir is None:
            raise SnapshotError("this kernel has no sandbox to save")
        try:
            await self.container.save_memory(image_dir, leave_running=leave_running)
        finally:
            if leave_running:
                await self._reattach_kernel()

    async def _reattach_kernel(self) -> None:
        """Listen again after a detach: the runtime dir opened and checked as at a start."""
        assert self.container is not None and self.runtime_dir is not None
        key = self.connection_info["key"]
        info = dict(self.connection_info, key=key.decode() if isinstance(key, bytes) else key)
        await asyncio.to_thread(self.runtime_dir.prepare, info, SANDBOX_GID)
        await self.container.attach_kernel()
        await self._wait_for_sockets()
        await asyncio.to_thread(self.runtime_dir.lock)

    # -- process control ------------------------------------------------------------------

    async def poll(self) -> int | None:
        if self.container is None:
            return -1
        return await self.container.kernel_exit_code()

    async def wait(self) -> int | None:
        while True:
            code = await self.poll()
            if code is not None:
                if self.container is not None:
                    self.container.exec_id = None
                return code
            await asyncio.sleep(0.05)

    async def send_signal(self, signum: int) -> None:
        if self.container is None:
            return
        if signum == signal.SIGKILL:
            await self.kill()
        elif signum != 0:
            await self.container.signal_kernel(signum)

    async def kill(self, restart: bool = False) -> None:
        """Kill the kernel and everything its code started; if that cannot run (fork bomb),
        kill the whole container, which the next launch replaces."""
        if self.container is None:
            return
        if not await self.container.kill_sandbox_processes():
            await self.container.stop_hard()

    async def terminate(self, restart: bool = False) -> None:
        if self.container is not None:
            await self.container.signal_kernel(signal.SIGTERM)

    async def cleanup(self, restart: bool = False) -> None:
        """On restart keep the container (and its workspace); otherwise remove everything."""
        if not restart:
            await self._release()

    async def _release(self) -> None:
        if self.container is not None:
            await self.container.remove()
            self.container = None
        if self.egress is not None:
            await self.egress.close()
            self.egress = None
        if self.runtime_dir is not None:
            await asyncio.to_thread(self.runtime_dir.remove)
        if self.workspace_disk is not None:  # after the container: nothing holds the mount now
            await asyncio.to_thread(self.workspace_disk.remove)
            self.workspace_disk = None
        if self.uid is not None:
            await asyncio.to_thread(UidAllocator(default_engine()).release, self.uid)
            self.uid = None

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return min(recommended, 3.0)

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        return recommended

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update(
            session_id=self.session_id,
            container_id=self.container.id if self.container else None,
            runtime_dir=str(self.runtime_dir.path) if self.runtime_dir else None,
            profile=self.profile.to_dict() if self.profile else None,
            workspace_disk=self.workspace_disk.to_dict() if self.workspace_disk else None,
        )
        return info
