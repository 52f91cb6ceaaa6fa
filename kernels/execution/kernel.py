"""The host's side of one sandboxed kernel: its manager, the session's own client, the drain.

What a session needs of its kernel and nothing about executions: start it and wait until both
its shell and its iopub answer, read verified messages, probe and renew a cut iopub
subscription, restart it, replace it (new manager, new container), tear it down. Every restart
or replacement bumps :attr:`epoch`, which a running execution compares to notice it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

from jupyter_client import AsyncKernelManager
from jupyter_client.asynchronous.client import AsyncKernelClient

from sandkernel.errors import KernelStartError, SandkernelError, SessionClosedError
from sandkernel.kernels.execution.adoption import reattach
from sandkernel.kernels.execution.connection_watch import ShellConnectionWatch
from sandkernel.kernels.execution.drain import IdleDrain
from sandkernel.kernels.execution.outputs import OutputCollector
from sandkernel.kernels.execution.transport import new_client, new_kernel_manager, next_message
from sandkernel.kernels.model.profiles import Profile
from sandkernel.kernels.sandbox.container import SandboxContainer
from sandkernel.kernels.sandbox.kernelspec import kernel_name_for
from sandkernel.kernels.sandbox.memory_checkpoint import SavedMemory
from sandkernel.kernels.sandbox.provisioner import DockerProvisioner
from sandkernel.kernels.sandbox.workspace_disk import KeptWorkspace

log = logging.getLogger(__name__)

SHELL_ASK_SECONDS = 1.0  # how long one kernel_info ask of a starting kernel waits (jupyter_client's)

# How long a renewed iopub subscription may take to answer (seconds).
IOPUB_RECONNECT_SECONDS = 10.0
# How long the first probe of a kernel whose sockets were detached and bound anew waits
# (seconds; each next one twice as long, up to 1 s): ZMQ reconnects every 100 ms (wait_reconnected).
RECONNECT_PROBE_SECONDS = 0.1
# How long a re-adopted kernel may take to answer on control (seconds): it is already running.
ADOPT_TIMEOUT = 15.0
# How long the probe after an unanswered start waits on each channel (seconds).
UNANSWERED_PROBE_SECONDS = 2.0


class SandboxedKernel:
    """One kernel in its container, as the session layer drives it."""

    def __init__(
        self,
        session_id: str,
        profile: Profile,
        profile_name: object,
        overrides: Mapping[str, Any],
        km: AsyncKernelManager | None = None,
        cpu_group: str | None = None,
        savable: bool = False,
    ) -> None:
        """``km``: a kernel manager already connected to a running sandbox (re-adoption);
        ``cpu_group``: the tenant's CPU group, kept by every container of the session."""
        self.session_id = session_id
        self.profile = profile
        self._launch = {
            "sandkernel_profile": profile_name,
            "sandkernel_overrides": dict(overrides),
            "sandkernel_session_id": session_id,
            "sandkernel_cpu_group": cpu_group,
            "sandkernel_savable": savable,
        }
        self.km: AsyncKernelManager = km or new_kernel_manager(kernel_name_for(profile.runtime))
        self.client: AsyncKernelClient | None = None
        self._shell_watch: ShellConnectionWatch | None = None  # savable sandboxes: see is_alive_unchanged
        self.epoch = 0  # bumped on every restart or replacement
        self.drain = IdleDrain(session_id, lambda: self.client)

    @property
    def kernel_id(self) -> str:
        return str(self.km.kernel_id)

    @property
    def provisioner(self) -> DockerProvisioner:
        provisioner = self.km.provisioner
        if not isinstance(provisioner, DockerProvisioner):
            raise SessionClosedError(f"session {self.session_id} has no running kernel; start a new session")
        return provisioner

    @property
    def container(self) -> SandboxContainer:
        container = self.provisioner.container
        if container is None:
            raise SessionClosedError(f"session {self.session_id} has no container; start a new session")
        return container

    async def start(
        self,
        workspace: dict[str, Any] | None = None,
        restore: SavedMemory | None = None,
        kept: KeptWorkspace | None = None,
    ) -> None:
        """Start the kernel and wait until it answers; on failure nothing is left running.
        ``workspace``: a disk workspace handed over by the previous provisioner (see replace);
        ``restore``: a saved kernel this start (only) carries on from; ``kept``: a workspace
        image a pause kept whole (checked, a copy of this session's), its /workspace."""
        launch = {**self._launch, "sandkernel_workspace": workspace} if workspace else self._launch
        if restore is not None:
            launch = {**launch, **restore.launch_kwargs()}
        if kept is not None:
            launch = {**launch, **kept.launch_kwargs()}
        try:
            await self.km.start_kernel(**launch)
            self._use_client(new_client(self.km))
            with self.drain.reading():
                await self._wait_ready()
        except BaseException:
            await self.teardown()
            raise
        self.drain.start()
        log.info("session started", extra={"session": self.session_id, "kernel": self.kernel_id})

    @classmethod
    async def adopt(cls, session_id: str, state: dict[str, Any]) -> SandboxedKernel:
        """The kernel of a sandbox a previous process started, checked and connected again (see
        kernels/execution/adoption.py). It may be busy with code that process left running: only
        the control channel is asked to answer, and iopub to carry that answer's status."""
        km = await reattach(session_id, state)
        provisioner = km.provisioner
        assert isinstance(provisioner, DockerProvisioner) and provisioner.profile is not None
        kernel = cls(session_id, provisioner.profile, provisioner.profile, {}, km=km, cpu_group=provisioner.cpu_group)
        try:
            kernel._use_client(new_client(km))
            with kernel.drain.reading():
                await kernel._wait_attached()
        except BaseException:
            await kernel.detach()
            raise
        kernel.drain.start()
        log.info("session re-adopted", extra={"session": session_id, "kernel": kernel.kernel_id})
        return kernel

    async def wait_reconnected(self) -> None:
        """Until the kernel's iopub reaches us again after its sockets were detached and bound
        anew (a fork's parent, a cell's checkpoint: kernels/sandbox/memory_checkpoint.py): the
        shell channel queues what is sent meanwhile, but output published before the
        subscription is back is lost."""
        deadline = time.monotonic() + self.profile.start_timeout
        wait = RECONNECT_PROBE_SECONDS
        with self.drain.reading():
            while time.monotonic() < deadline:
                # A probe published before the subscription is back is lost, and ZMQ retries the
                # connection every 100 ms: a first short probe finds it back that soon, where a
                # 0.5 s wait for a lost probe held every fork (0.5 s of a fork of 3, measured).
                # Each next probe waits twice as long, so a slow kernel's answer still fits one.
                if await self.iopub_answers(wait):
                    return
                wait = min(2 * wait, 1.0)
        limit = self.profile.start_timeout
        raise KernelStartError(f"the kernel's output did not reach the gateway again within {limit:g}s")

    async def _wait_attached(self) -> None:
        """Until the adopted kernel answers on control and its iopub reaches us."""
        deadline = time.monotonic() + min(self.profile.start_timeout, ADOPT_TIMEOUT)
        while time.monotonic() < deadline:
            if await self.iopub_answers(0.5, on_control=True):
                return
            if not await self.is_alive():
                return  # dead kernel: the next execute restarts it, as after any death
        raise KernelStartError(f"the re-adopted kernel did not answer within {ADOPT_TIMEOUT:g}s")

    async def read(self, channel: str, timeout: float) -> dict[str, Any]:
        """The next verified message on our own iopub or shell; raises queue.Empty."""
        assert self.client is not None
        return await next_message(self.client, channel, timeout, self.session_id)

    async def read_shell(self, timeout: float) -> dict[str, Any]:
        return await self.read("shell", timeout)

    async def is_alive(self) -> bool:
        return bool(await self.km.is_alive())

    async def is_alive_unchanged(self) -> bool:
        """:meth:`is_alive`, for the check before each execute: a savable sandbox whose shell
        connection stayed up since a probe found its kernel alive is not probed again (a probe
        crosses the supervisor's relay; see connection_watch.py)."""
        watch = self._shell_watch
        if watch is not None and watch.steady():
            return True
        alive = await self.is_alive()
        if alive and watch is not None:
            watch.confirm()
        return alive

    def _use_client(self, client: AsyncKernelClient) -> None:
        """Make ``client`` the session's own, watched when the sandbox is savable."""
        if self._shell_watch is not None:  # the last client's, if its stop was skipped
            self._shell_watch.close()
            self._shell_watch = None
        self.client = client
        provisioner = self.km.provisioner
        container = provisioner.container if isinstance(provisioner, DockerProvisioner) else None
        if container is not None and container.spec.savable:
            self._shell_watch = ShellConnectionWatch(client.shell_channel.socket)

    def _stop_client(self) -> None:
        if self._shell_watch is not None:
            self._shell_watch.close()
            self._shell_watch = None
        if self.client is not None:
            self.client.stop_channels()

    async def interrupt(self) -> None:
        await self.km.interrupt_kernel()

    async def _wait_ready(self) -> None:
        """Wait until the kernel answers on shell AND its iopub reaches us.

        A SUB socket joins late (more so across gVisor): without the nudge the first
        execute's ``idle`` status can be lost and the execute would wait for its timeout.
        """
        assert self.client is not None
        deadline = time.monotonic() + self.profile.start_timeout
        try:
            await self._shell_answers(deadline)
        except RuntimeError as err:
            seen = await self._what_an_unanswered_start_saw()
            log.warning("kernel start unanswered: %s; %s", err, seen, extra={"session": self.session_id})
            raise KernelStartError(f"sandboxed kernel did not answer: {err}; {seen}") from err
        while time.monotonic() < deadline:
            if await self.iopub_answers(0.25):
                return
        raise KernelStartError(f"the kernel's output channel did not connect within {self.profile.start_timeout:g}s")

    async def _shell_answers(self, deadline: float) -> None:
        """Ask kernel_info on shell until it is answered (each ask waits up to
        :data:`SHELL_ASK_SECONDS`); RuntimeError when the kernel dies first or ``deadline``
        passes. jupyter_client's ``wait_for_ready`` does the same, then waits 0.2 s more on iopub
        for every start, which :meth:`_wait_ready` checks its own way."""
        assert self.client is not None
        while True:
            asked = self.client.kernel_info()
            ask_until = min(deadline, time.monotonic() + SHELL_ASK_SECONDS)
            with contextlib.suppress(queue.Empty):
                while (remaining := ask_until - time.monotonic()) > 0:
                    reply = await self.read_shell(remaining)
                    if reply.get("parent_header", {}).get("msg_id") == asked:
                        self.client._handle_kernel_info_reply(reply)  # the protocol version, as wait_for_ready
                        return
            if not await self.km.is_alive():
                raise RuntimeError("Kernel died before replying to kernel_info")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"Kernel didn't respond in {self.profile.start_timeout:g} seconds")

    async def _what_an_unanswered_start_saw(self) -> str:
        """What a start that timed out can still tell, for its error and the log: whether the
        kernel process runs, whether one last probe reached it (its status on iopub, its reply
        on shell) and the tail of its log. A kernel that runs and answers the probe late was slow;
        one that runs and answers neither channel has lost its connection to the host."""
        parts = []
        try:
            code = await self.provisioner.container.kernel_exit_code()
            parts.append("kernel process running" if code is None else f"kernel process exited ({code})")
            iopub = await self.iopub_answers(UNANSWERED_PROBE_SECONDS)
            shell = 0
            with contextlib.suppress(queue.Empty):
                while True:
                    await self.read("shell", 0.1 if shell else UNANSWERED_PROBE_SECONDS)
                    shell += 1
            parts.append(f"a last probe: iopub {'answered' if iopub else 'silent'}, {shell} shell replies waiting")
            parts.append(f"kernel log: {(await self.provisioner.container.kernel_log()).strip()[-1000:] or '(empty)'}")
        except Exception as err:  # the diagnosis never hides the start's own error
            parts.append(f"no more known ({type(err).__name__})")
        return "; ".join(parts)

    async def iopub_answers(
        self,
        wait: float,
        msg_id: str | None = None,
        collector: OutputCollector | None = None,
        on_control: bool = False,
        on_end: Callable[[], None] | None = None,
    ) -> bool:
        """Send a kernel_info request and wait up to ``wait`` seconds for its status on iopub.

        Messages of a running execution ``msg_id`` that arrive meanwhile go to ``collector``, and
        its idle status, if it comes, calls ``on_end``.
        ``on_control``: ask on the control channel, which a kernel busy running code still
        answers (its reply is read and dropped here)."""
        assert self.client is not None
        if on_control:
            request = self.client.session.msg("kernel_info_request")
            self.client.control_channel.send(request)
            probe_id = request["header"]["msg_id"]
        else:
            probe_id = self.client.kernel_info()
        deadline = time.monotonic() + wait
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = await self.read("iopub", remaining)
            except queue.Empty:
                return False
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent == probe_id:
                if on_control:
                    with contextlib.suppress(queue.Empty, asyncio.TimeoutError):
                        await asyncio.wait_for(self.client.get_control_msg(timeout=1), 2)
                return True
            if parent != msg_id or msg_id is None:
                continue
            if msg["header"]["msg_type"] != "status":
                if collector is not None:
                    await collector.add(msg)
            elif on_end is not None and msg["content"].get("execution_state") == "idle":
                on_end()
        return False

    async def reconnect_iopub(self) -> None:
        """A fresh client, so a fresh iopub subscription. ZMQ drops a subscriber that receives a
        message over the transport's size cap and does not bring it back: without this, every
        later output of the session would be lost. Called only after the running execution's
        reply was read, so nothing in flight on the old shell socket is lost."""
        assert self.client is not None
        log.warning("iopub went silent (over the size cap?); reconnecting", extra={"session": self.session_id})
        with contextlib.suppress(Exception):
            self._stop_client()
        self._use_client(new_client(self.km))
        deadline = time.monotonic() + IOPUB_RECONNECT_SECONDS
        while time.monotonic() < deadline and not await self.iopub_answers(0.25):
            pass

    async def restart(self) -> tuple[bool, bool]:
        """Restart the kernel. Returns (container replaced, workspace lost): a replaced
        container takes /workspace with it only when that was a tmpfs; a disk workspace stays."""
        self.epoch += 1
        provisioner = self.provisioner
        with self.drain.reading():
            await self.km.restart_kernel(now=True)
            await self._wait_ready()
        return provisioner.container_replaced, provisioner.workspace_lost

    async def replace(self) -> bool:
        """Throw away the kernel manager and container, and start from scratch. A disk
        workspace (and the uid that owns its files) is handed to the new provisioner: True
        when it was, so /workspace files are kept.

        The kernel id stays, as after a Jupyter restart: a client holding it (JupyterLab, a
        websocket user, nbclient) reconnects to the new kernel instead of finding none."""
        self.epoch += 1
        provisioner = self.km.provisioner
        handed = provisioner.hand_over_workspace() if isinstance(provisioner, DockerProvisioner) else None
        kernel_id = self.km.kernel_id
        await self.teardown()
        self.km = new_kernel_manager(self.km.kernel_name)
        self.km.kernel_id = kernel_id
        self.client = None
        await self.start(handed)
        return handed is not None

    async def teardown(self) -> None:
        """Stop the client and the kernel, and remove the container and its runtime dir."""
        self._stop_client()
        if self.km.provisioner is not None:
            with contextlib.suppress(SandkernelError, RuntimeError):
                await self.km.shutdown_kernel(now=True)
            if isinstance(self.km.provisioner, DockerProvisioner):
                await self.km.provisioner.cleanup(restart=False)

    async def detach(self) -> None:
        """Let go of the sandbox without ending it (the gateway stops; the next one re-adopts):
        stop the drain and our client, close the egress proxy's socket, and leave the container,
        its runtime dir, its workspace disk and its uid as they are."""
        await self.drain.stop()
        self._stop_client()
        self.km._close_control_socket()
        provisioner = self.km.provisioner
        if isinstance(provisioner, DockerProvisioner) and provisioner.egress is not None:
            await provisioner.egress.close(keep_directory=True)  # the container's mount names it

    async def close(self) -> None:
        """Stop the drain, then tear down. Safe to call twice."""
        await self.drain.stop()
        await self.teardown()
