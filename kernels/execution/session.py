"""The session: one sandboxed kernel, and the one execution tracker every door goes through.

The gateway's session API, its Jupyter websocket, the agent and replay all run code through
:meth:`KernelSession.execute` or, for a door that must send the kernel's request itself so its
client sees every message unchanged (the websocket), :meth:`KernelSession.execute_relayed`.
Both take the same path: executions on one kernel are serialised by a lock; a watchdog beside
each one notices a dead kernel and tells an OOM kill from a crash; a wall-clock timeout climbs
a ladder (interrupt → grace → restart the kernel → replace the container) and says which rung
ended it; outputs are collected within the same byte budgets. What happened is told to the
layers above as events (see events.py): the session calls no recorder, metrics or audit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import docker.errors
from jupyter_client import AsyncKernelManager

from sandkernel.errors import (
    ArgumentTypeError,
    ConfigError,
    SandkernelError,
    SessionClosedError,
    SessionDetachedError,
    SnapshotError,
)
from sandkernel.kernels.execution.accounting import CellMeter
from sandkernel.kernels.execution.adoption import discard as discard_sandbox
from sandkernel.kernels.execution.adoption import durable_state
from sandkernel.kernels.execution.deaths import DeathClassifier
from sandkernel.kernels.execution.events import (
    ALLOW,
    ExecutionGate,
    ExecutionRequest,
    Observers,
    SessionObserver,
    Verdict,
)
from sandkernel.kernels.execution.kernel import SandboxedKernel
from sandkernel.kernels.execution.outputs import (
    ExecutionResult,
    ExecutionStatus,
    OutputCallback,
    OutputCollector,
    TimeoutStep,
    refused_result,
)
from sandkernel.kernels.execution.replies import OrphanReply, OwnShellReplies, RelayedReply, ReplySource
from sandkernel.kernels.execution.variables import list_variables
from sandkernel.kernels.execution.watch import ExecutionWatch
from sandkernel.kernels.model.profiles import NUMERIC_RANGES, Profile, resolve_profile
from sandkernel.kernels.sandbox.bulk_io import bulk_io
from sandkernel.kernels.sandbox.container import SandboxContainer
from sandkernel.kernels.sandbox.memory_checkpoint import SavedMemory
from sandkernel.kernels.sandbox.provisioner import DockerProvisioner
from sandkernel.kernels.sandbox.workspace_disk import KeptWorkspace

log = logging.getLogger(__name__)

# The longest timeout an execution may ask for (seconds): the profile setting's own ceiling.
MAX_EXECUTE_TIMEOUT = NUMERIC_RANGES["execute_timeout"][1]
# How long a shutdown waits for the running execution to return its outputs so far (status
# ``deleted``) before it closes the kernel under it (seconds): the watch notices within its
# watchdog interval, unless the execution is in its own restart.
SHUTDOWN_GRACE = 5.0


def _utcnow() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def _cancelling() -> bool:
    """Whether the current task is being cancelled (not merely woken by a CancelledError that a
    closed socket's pending read raised)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+; before it, taken as not
    return cancelling is not None and cancelling() > 0


def _retrieve(task: asyncio.Task) -> None:
    """A restart's outcome is its callers'; a task whose callers all went away is logged here,
    never as an unretrieved exception."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("a restart nobody waited for failed: %s", task.exception())


def check_timeout(timeout: object) -> float:
    """A timeout a caller asked for, as float seconds; ConfigError names the allowed range."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_EXECUTE_TIMEOUT:
        raise ConfigError(f"timeout must be a number of seconds between 0 and {MAX_EXECUTE_TIMEOUT:g}, not {timeout!r}")
    return float(timeout)


class KernelSession:
    """A sandboxed IPython kernel with a serialised, bounded ``execute``.

    Create with ``await KernelSession.start(profile=..., overrides=...)`` or use it as an async
    context manager; :meth:`shutdown` removes the container and its runtime dir. Attach
    observers (:meth:`add_observer`) to hear about executions, notes and restarts.
    """

    def __init__(
        self,
        profile: str | Profile | None = None,
        overrides: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        kernel: SandboxedKernel | None = None,
        cpu_group: str | None = None,
        savable: bool = False,
    ) -> None:
        """``kernel``: an adopted kernel (see :meth:`adopt`); otherwise one is started by
        :meth:`start`, its sandbox in ``cpu_group`` (the tenant's, kernels/sandbox/cpu_groups.py),
        savable (gVisor memory snapshots: :meth:`save_memory`) when asked."""
        # Validate everything that can be validated before a container exists.
        self.profile: Profile = kernel.profile if kernel else resolve_profile(profile, overrides)
        self.id = kernel.session_id if kernel else session_id or uuid.uuid4().hex
        self._kernel = kernel or SandboxedKernel(
            self.id, self.profile, profile, overrides or {}, cpu_group=cpu_group, savable=savable
        )
        self._lock = asyncio.Lock()
        # One memory save at a time: a cell's checkpoint (the sandbox goes on) and a pause that
        # came meanwhile (it ends the sandbox) each detach, save and attach whole.
        self._saving = asyncio.Lock()
        self._pending_state_lost: str | None = None
        self._interrupt_requested = False
        self._deaths = DeathClassifier(self.profile.memory_mb)
        self._notes: list[str] = []  # state-loss notes, told to observers after the cell
        self._closed = False
        self._detaching = False  # the gateway is letting go: the running execution returns now
        self._running: ExecutionRequest | None = None
        self._execution_ended: asyncio.Event | None = None  # set when the execution holding the lock returns
        # The restart under way (asked for, the timeout ladder's, after a death): one at a time,
        # and a call while one is under way joins it (see _restart_or_replace).
        self._restarting: asyncio.Task[TimeoutStep] | None = None
        self._restart_replaces = False  # whether that restart replaces the container if it must
        self._orphan_task: asyncio.Task | None = None  # an execution a previous process left running
        self.observers = Observers(self.id)
        self._gates: list[ExecutionGate] = []
        self._after_execution: list[Callable[[], Awaitable[None]]] = []  # see after_execution
        # Measures each cell on the host (CPU, peak memory, files, egress, packages); None: off.
        self.meter: CellMeter | None = CellMeter(self)
        self._own_replies = OwnShellReplies(self._kernel.read_shell)

    @classmethod
    async def start(
        cls,
        profile: str | Profile | None = None,
        overrides: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        observers: tuple[SessionObserver, ...] = (),
        cpu_group: str | None = None,
        savable: bool = False,
        restore: SavedMemory | None = None,
        kept: KeptWorkspace | None = None,
    ) -> KernelSession:
        """A started session. ``savable``: gVisor only, its memory can be saved
        (:meth:`save_memory`); ``restore``: what that method saved, whose kernel carries on here
        (with this session's new key) instead of a fresh one; ``kept``: a workspace image a
        pause kept whole (:meth:`keep_workspace_disk`), checked and copied for this session, which
        becomes its /workspace (moved, not copied again), the sandbox running as its files' uid."""
        session = cls(profile, overrides, session_id, cpu_group=cpu_group, savable=savable or restore is not None)
        for observer in observers:
            session.add_observer(observer)
        await session._kernel.start(restore=restore, kept=kept)
        return session

    @property
    def savable(self) -> bool:
        """Whether :meth:`save_memory` can save this session's kernel (a gVisor savable sandbox)."""
        return self._kernel.provisioner.savable

    async def save_memory(self, image_dir: Path, *, leave_running: bool = False) -> SavedMemory:
        """Write the kernel's memory to ``image_dir`` (a new directory). Call with no execution
        running (hold :meth:`exclusive`, or be the gate that holds the next cell back: a cell's
        checkpoint). The sandbox ends with it (then :meth:`shutdown`) unless ``leave_running``: a
        fork's parent or a checkpointed session goes on, listening again once the image is
        written."""
        provisioner = self._kernel.provisioner
        async with self._saving:
            try:
                await provisioner.save_memory(image_dir, leave_running=leave_running)
            finally:
                if leave_running:
                    await self._kernel.wait_reconnected()
        if provisioner.uid is None:  # shut down meanwhile (a delete): the image has no owner to run as
            raise SnapshotError(f"session {self.id} ended while its memory was saved")
        return SavedMemory(image_dir, provisioner.uid)

    async def workspace_disk_bytes(self) -> int | None:
        """What the session's workspace disk image takes on the host's disk now (its blocks, the
        freed ones of deleted files included), None for a tmpfs workspace."""
        disk = self._kernel.provisioner.workspace_disk
        return None if disk is None else await asyncio.to_thread(disk.allocated_bytes)

    @property
    def cpu_group(self) -> str | None:
        """The tenant's CPU group the sandbox runs in (kernels/sandbox/cpu_groups.py), None outside one."""
        return self._kernel.provisioner.cpu_group

    @property
    def has_container(self) -> bool:
        """Whether the session still has its container (:meth:`keep_workspace_disk` removes it)."""
        return self._kernel.provisioner.container is not None

    async def flush_workspace_disk(self, owner: str) -> None:
        """Write the /workspace disk's dirty data to its image now (WorkspaceDisk.flush), in
        ``owner``'s lane of the bulk file threads; nothing for a tmpfs workspace. A failure is
        only logged: the pause's or the fork's own flush comes after it anyway."""
        disk = self._kernel.provisioner.workspace_disk
        if disk is None:
            return
        try:
            await bulk_io().run(owner, disk.flush)
        except (SandkernelError, OSError) as err:
            log.info("the workspace disk was not flushed ahead: %s", err, extra={"session": self.id})

    async def copy_workspace_disk(self, target: Path, owner: str) -> int | None:
        """Copy the running sandbox's /workspace disk image, whole, to ``target`` (a fork, after
        :meth:`save_memory` with ``leave_running``): its filesystem frozen meanwhile, so the copy
        is consistent (WorkspaceDisk.copy_image), in ``owner``'s lane of the bulk file threads
        (kernels/sandbox/bulk_io.py). The uid that owns its files; None, with nothing copied, when
        the session has no disk workspace or the copy failed."""
        disk = self._kernel.provisioner.workspace_disk
        if disk is None:
            return None
        try:
            await bulk_io().run(owner, disk.copy_image, target)
        except (SandkernelError, OSError) as err:
            log.warning("the workspace disk could not be copied: %s", err, extra={"session": self.id})
            return None
        return disk.uid

    async def keep_workspace_disk(self, target: Path, owner: str) -> int | None:
        """End the sandbox (a pause, after :meth:`save_memory`) and move its /workspace disk
        image, whole, to ``target`` (WorkspaceDisk.release_image), instead of removing it with
        the sandbox. The container goes first, so that nothing holds the filesystem when it is
        unmounted (a gofer's mount namespace would keep it alive, its last writes unflushed).
        The trim and move run in ``owner``'s lane of the bulk file threads. The uid that owns its
        files (a later sandbox on it must run as that uid); None, with nothing moved, when the
        session has no disk workspace or it cannot be released: the disk is then removed with the
        session as usual."""
        provisioner = self._kernel.provisioner
        if provisioner.workspace_disk is None:
            return None
        try:
            if provisioner.container is not None:
                await provisioner.container.remove()
                provisioner.container = None
        except docker.errors.DockerException as err:
            log.warning("the sandbox could not be removed to keep its disk: %s", err, extra={"session": self.id})
            return None
        disk = provisioner.detach_workspace_disk()
        assert disk is not None
        try:
            await bulk_io().run(owner, disk.release_image, target)
        except (SandkernelError, OSError) as err:
            log.warning("the workspace disk could not be kept whole: %s", err, extra={"session": self.id})
            provisioner.workspace_disk = disk  # cleanup removes it as usual
            return None
        return disk.uid

    async def until_saved(self) -> None:
        """Until no save of the kernel's memory is under way. A fork's parent and a checkpointed
        cell's session stay up, but their kernel's sockets are detached for as long as the save
        takes (seconds, more on a loaded host) and come back after it."""
        async with self._saving:
            pass

    @classmethod
    async def adopt(cls, session_id: str, state: dict[str, Any]) -> KernelSession:
        """The session of a sandbox a previous process started, from its :meth:`durable_state`.

        Connects after the checks of kernels/execution/adoption.py and emits nothing: attach the
        observers, then call :meth:`resume`. Raises SandboxLostError (the container died or was
        removed; :meth:`discard` clears what is left) or AdoptionRefusedError (not what was
        recorded; left alone)."""
        return cls(kernel=await SandboxedKernel.adopt(session_id, state))

    @staticmethod
    async def discard(session_id: str, state: dict[str, Any]) -> None:
        """Remove what is left of a recorded sandbox that will not be adopted (lost, or deleted
        while lost): its container if still there, runtime dir, workspace disk, uid."""
        await discard_sandbox(session_id, state)

    def durable_state(self) -> dict[str, Any]:
        """What a later process needs to re-adopt this sandbox (JSON; holds the kernel's key:
        store it where only the operator can read it)."""
        return durable_state(self.provisioner, self._kernel.km)

    @property
    def state_lost_pending(self) -> bool:
        """The kernel's memory was lost after the last execution (a restart) and no execution has
        said so yet: a snapshot taken now holds nothing of the recorded cells in memory."""
        return self._pending_state_lost is not None

    @property
    def running_request(self) -> ExecutionRequest | None:
        """The execution in flight, if any (the gateway records it, to settle after a restart)."""
        return self._running

    async def resume(self, running: Mapping[str, Any] | None = None, detached_at: str | None = None) -> None:
        """Carry on after a gap with no process attached (an adopted session, observers attached).

        Notes the gap. ``running`` is the execution a previous process recorded as in flight
        (:class:`ExecutionRequest` fields plus ``started_at``): it may still be running. It is
        then settled as an execution of its own, holding the execute lock, so later executes
        queue behind it as they would have: outputs from now on are collected, its remaining time
        and the timeout ladder apply, and it is recorded with what is known of its end."""
        since = f"from {detached_at} " if detached_at else ""
        await self.note(
            f"the gateway restarted: no gateway was attached {since}until {_utcnow()}; "
            "output the kernel produced meanwhile is missing, not recorded"
        )
        if running is not None:
            holding = asyncio.Event()
            task = asyncio.create_task(self._settle_orphan(dict(running), holding))
            self._orphan_task = task
            await holding.wait()

    async def _settle_orphan(self, running: dict[str, Any], holding: asyncio.Event) -> None:
        """See :meth:`resume`: the recorded execution, watched to its end from the shell probe."""
        msg_id = str(running.get("msg_id") or "")
        code = str(running.get("code") or "")
        timeout = float(running.get("timeout") or self.profile.execute_timeout)
        started_at = str(running.get("started_at") or "")
        try:
            elapsed = (dt.datetime.now(dt.timezone.utc) - dt.datetime.fromisoformat(started_at)).total_seconds()
        except ValueError:
            elapsed = 0.0
        replies = OrphanReply(self._kernel.read_shell)

        def probe() -> str:
            assert self._kernel.client is not None
            replies.probe_id = self._kernel.client.kernel_info()  # answered once the orphan ends
            return msg_id

        def settled(result: ExecutionResult) -> ExecutionResult:
            # It ended before we could watch (iopub never showed its end, see OrphanReply):
            # nothing of its end is known.
            if replies.ended_unseen and not result.outputs:
                return dataclasses.replace(
                    result, status=ExecutionStatus.DETACHED, ended_by=TimeoutStep.GATEWAY_RESTART, started_at=started_at
                )
            return dataclasses.replace(result, started_at=started_at or result.started_at)

        try:
            await self._run(
                code,
                max(timeout - elapsed, 0.05),
                probe,
                replies,
                None,
                running.get("tag"),
                str(running.get("source") or "python"),
                silent=bool(running.get("silent")),
                holding=holding,
                settle=settled,
            )
        except SandkernelError as err:
            log.warning("could not settle the execution left running: %s", err, extra={"session": self.id})
        finally:
            holding.set()

    def add_observer(self, observer: SessionObserver) -> None:
        """Hear this session's events from now on (at start, or when a pooled session is handed out)."""
        self.observers.add(observer)

    def remove_observer(self, observer: SessionObserver) -> None:
        self.observers.remove(observer)

    def after_execution(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` once the execution being reported has been heard by every observer,
        before the next execute starts: how an observer acts on the session (the breaker
        restarting its kernel) without calling back into it half-way through an event."""
        self._after_execution.append(work)

    async def _run_after_execution(self) -> None:
        while self._after_execution:
            work = self._after_execution.pop(0)
            try:
                await work()
            except SandkernelError as err:  # the result stands; the next execute meets the state
                log.warning("work queued after an execution failed: %s", err, extra={"session": self.id})

    def add_gate(self, gate: ExecutionGate) -> None:
        """Ask ``gate`` about every execution from now on, before it reaches the kernel."""
        self._gates.append(gate)

    def remove_gate(self, gate: ExecutionGate) -> None:
        if gate in self._gates:
            self._gates.remove(gate)

    def set_accounting(self, enabled: bool) -> None:
        """Measure each cell (the default) or not (the operator turned accounting off)."""
        if not enabled:
            if self.meter is not None:
                self.meter.close()  # its fanotify watch and cgroup files
            self.meter = None
        elif self.meter is None:
            self.meter = CellMeter(self)

    async def _admit(self, request: ExecutionRequest) -> Verdict:
        """Every gate's verdict on ``request``, in order: the first refusal stops the asking;
        findings add up. A gate that raises counts as allowing (see ExecutionGate)."""
        if not self._gates:
            return ALLOW
        findings: list[dict[str, Any]] = []
        for gate in list(self._gates):
            try:
                verdict = await gate.admit(request)
            except Exception:
                log.exception("execution gate %s failed; allowing", type(gate).__name__, extra={"session": self.id})
                continue
            findings.extend(verdict.findings)
            if verdict.refusal is not None:
                return Verdict(tuple(findings), verdict.refusal)
        return Verdict(tuple(findings))

    async def note(self, text: str) -> None:
        """Tell the observers something a reader of the session's record must know (markdown)."""
        await self.observers.emit("note_added", text)

    def egress_records(self) -> list[dict[str, Any]] | None:
        """Every request through this session's egress proxy; None when its network is "none"."""
        proxy = self.provisioner.egress
        return None if proxy is None else [record.to_dict() for record in proxy.records]

    def describe(self) -> dict[str, Any]:
        """What a transcript reader needs to know about this sandbox."""
        provisioner = self.provisioner
        return {
            "session_id": self.id,
            "kernel_id": self.kernel_id,
            "image": self.profile.image,
            "image_id": provisioner.image_id,
            "runtime": self.profile.runtime.value,
            "limits": self.profile.to_dict(public=True),  # tenants can read the transcript
        }

    async def __aenter__(self) -> KernelSession:
        if self._kernel.client is None:
            await self._kernel.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- properties -----------------------------------------------------------------------

    @property
    def kernel_id(self) -> str:
        return self._kernel.kernel_id

    @property
    def kernel_manager(self) -> AsyncKernelManager:
        return self._kernel.km

    @property
    def provisioner(self) -> DockerProvisioner:
        return self._kernel.provisioner

    @property
    def container(self) -> SandboxContainer:
        return self._kernel.container

    @property
    def busy(self) -> bool:
        """Whether an execution is running or queued."""
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold while nothing may execute (``async with session.exclusive():``): executes by any
        door queue until it is released, and a restart under way has ended first. A snapshot
        holds it while it archives the files (a restart during the capture waits for the
        snapshot in the gateway: gateway/registry.py ``for_kernel_call``)."""
        async with self._lock:
            await self._restart_settled()
            yield

    @property
    def restarting(self) -> bool:
        """Whether a restart (or the container's replacement) is under way."""
        return self._restarting is not None and not self._restarting.done()

    # -- lifecycle ------------------------------------------------------------------------

    async def cut_running(self) -> None:
        """The gateway stops: the running execution returns now, status ``detached`` (ended_by
        ``gateway_restart``) with the outputs so far; its code keeps running in the kernel, and
        executes queued behind it are refused with SessionDetachedError (503: retry)."""
        self._detaching = True

    async def detach(self, grace: float = 5.0) -> None:
        """Let go of the sandbox and leave it running for the next process to re-adopt. A running
        execution is cut (:meth:`cut_running`); waits up to ``grace`` seconds for it to return."""
        if self._closed:
            return
        self._detaching = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wait_idle(), grace)
        self._closed = True
        await self.note(f"the gateway stopped at {_utcnow()}; the sandbox keeps running for the next one")
        await self._kernel.detach()
        await self.observers.emit("session_closed")
        log.info("session detached", extra={"session": self.id})

    async def shutdown(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Stop the kernel and remove its container and runtime dir. Safe to call twice.

        A running execution returns first, within ``grace`` seconds, with its outputs so far and
        status ``deleted`` (recorded as such); executes queued behind it are refused
        (SessionClosedError). A restart under way ends first: its kernel is never closed
        half-started."""
        if self._closed:
            return
        self._closed = True
        ended = self._execution_ended
        if ended is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ended.wait(), grace)
        await self._restart_settled()
        await self._kernel.close()
        await self._note_discarded()
        await self.observers.emit("session_closed")
        log.info("session shut down", extra={"session": self.id})

    async def variables(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """A cheap listing of the user's namespace: name, type, size (len or bytes), shape.

        Evaluated as a silent ``user_expressions`` request: no output, no execution count. The
        observers get a note that it ran (it is an audit record). Queued behind running
        executions like any request.
        """
        self._check_open()
        async with self.exclusive():
            self._check_open()
            assert self._kernel.client is not None
            await self._note_discarded()
            await self.note("the session's variables were listed (a silent `user_expressions` request)")
            with self._kernel.drain.reading():
                return await list_variables(self._kernel.client, self._kernel.read_shell, timeout)

    async def wait_idle(self) -> None:
        """Return once no execution is running (the next queued one may start right after)."""
        async with self._lock:
            pass

    def expect_interrupt(self) -> None:
        """A door forwarded an interrupt to the kernel itself (a websocket's ``interrupt_request``
        on control): the running execution's KeyboardInterrupt ends it as ``interrupted``."""
        self._interrupt_requested = True

    async def interrupt(self) -> bool:
        """Interrupt the running execution (it ends with status ``interrupted``). Returns False,
        having sent nothing, while a restart is under way: the restart ends the running cell."""
        self._check_open()
        if self.restarting:
            return False
        self._interrupt_requested = True
        await self._kernel.interrupt()
        return True

    async def restart(self, reason: str = "the kernel was restarted on request") -> None:
        """Restart the kernel: memory state is dropped, /workspace files are kept. ``reason``
        is what the transcript and observers are told (who asked). A restart asked for while
        one is under way joins it: both callers get the outcome of the one restart. A kernel
        that does not come back (refused at its start, say) is an error for the callers; the next
        execute then restarts or replaces it, as after any death.

        Not behind the execute lock: restart is how a caller rescues a stuck execution (the
        running execute sees the epoch change and returns ``restarted``). Raises
        SessionClosedError when the session was shut down before or during it."""
        self._check_open()
        await self._note_discarded()
        await self._restart_or_replace(reason, None)
        self._check_open()
        await self._flush_notes()

    async def _note_discarded(self) -> None:
        """Tell the observers how much output arrived while no execution was running."""
        messages, size = self._kernel.drain.take_discarded()
        if messages:
            await self.note(
                f"output after the cell returned: {messages} messages, {size} bytes discarded "
                "(code kept writing while no execution was running)"
            )

    async def _flush_notes(self) -> None:
        notes, self._notes = self._notes, []
        for note in notes:
            await self.note(note)

    async def _restart_kernel(self, reason: str) -> TimeoutStep:
        """Restart and report whether the container had to be replaced (and the workspace with it)."""
        replaced, workspace_lost = await self._kernel.restart()
        if replaced:
            self._deaths.forget_container()
        if workspace_lost:
            detail = "; the container was replaced, so /workspace files are gone too"
        elif replaced:
            detail = "; the container was replaced: variables and imports are gone, /workspace files are kept"
        else:
            detail = "; variables and imports are gone, /workspace files are kept"
        self._pending_state_lost = reason + detail
        self._notes.append(self._pending_state_lost)
        await self.observers.emit("kernel_restarted", reason, replaced)
        return TimeoutStep.KILL if replaced else TimeoutStep.RESTART

    def _check_open(self) -> None:
        if self._detaching:
            raise SessionDetachedError(
                f"the gateway is restarting; session {self.id} keeps running: retry in a few seconds"
            )
        if self._closed:
            raise SessionClosedError(f"session {self.id} is shut down; start a new session")

    # -- execute --------------------------------------------------------------------------

    async def execute(
        self,
        code: str,
        timeout: float | None = None,
        on_output: OutputCallback | None = None,
        tag: str | None = None,
        source: str = "python",
        shell: str | None = None,
        on_result: Callable[[ExecutionResult], None] | None = None,
    ) -> ExecutionResult:
        """Run ``code`` in the kernel and return its ordered outputs and status.

        ``on_output`` is awaited with each output (nbformat shape) as it arrives, for streaming.
        ``source`` names the door, for the observers (the transcript records it). ``shell`` is
        the command when ``code`` is the cell sandkernel.shell made for it (gates review the
        command). A gate may refuse the code: status ``refused``, nothing ran.

        ``timeout`` is wall-clock seconds (default: the profile's ``execute_timeout``). Errors
        in the code are returned as status ``error``; timeouts, interrupts, kernel deaths and
        OOM kills as their statuses. Raises only for bad arguments or a closed session.

        ``on_result`` is called with the result before the observers hear of it, so a door can
        answer its client first: the observers' bookkeeping (transcript, catalog, audit,
        metrics) then runs before this returns, still holding the execute lock: most observers
        only queue their slow work, so no execute can see the reply's effects unrecorded. Work an
        observer queues with :meth:`after_execution` (the breaker's restart) runs once every
        observer has heard the result, still before the next execute.
        Should it raise, the observers are still told and its exception is raised after them.
        """
        if not isinstance(code, str):
            raise ArgumentTypeError(f"code must be a string of Python source, not {type(code).__name__}")
        limit = self.profile.execute_timeout if timeout is None else check_timeout(timeout)

        def send() -> str:
            assert self._kernel.client is not None
            return self._kernel.client.execute(code, allow_stdin=False, stop_on_error=False)

        return await self._run(
            code, limit, send, self._own_replies, on_output, tag, source, silent=False, shell=shell, on_result=on_result
        )

    async def execute_relayed(
        self,
        code: str,
        send: Callable[[], str],
        reply: RelayedReply,
        *,
        silent: bool = False,
        timeout: float | None = None,
        source: str = "websocket",
    ) -> ExecutionResult:
        """Run an ``execute_request`` that a door sends itself, on the same path as :meth:`execute`.

        ``send`` is called once this execution's turn has come (the session's lock is held); it
        sends the door's own request on the door's own socket, so its client sees every message
        unchanged, and returns the request's msg_id. The door hands the kernel's
        ``execute_reply`` to ``reply`` when it arrives on its socket. Serialisation, the timeout
        ladder (default: the profile's ``execute_timeout``), death and OOM classification, output
        budgets and events are those of every execution. A refused execution (status
        ``refused``) never calls ``send``: the door answers its client itself.
        """
        limit = self.profile.execute_timeout if timeout is None else check_timeout(timeout)
        return await self._run(code, limit, send, reply, None, None, source, silent=silent)

    async def _run(
        self,
        code: str,
        timeout: float,
        send: Callable[[], str],
        replies: ReplySource,
        on_output: OutputCallback | None,
        tag: str | None,
        source: str,
        silent: bool,
        holding: asyncio.Event | None = None,
        settle: Callable[[ExecutionResult], ExecutionResult] | None = None,
        shell: str | None = None,
        on_result: Callable[[ExecutionResult], None] | None = None,
    ) -> ExecutionResult:
        """``holding`` is set once the lock is held; ``settle`` adjusts the result before the
        observers hear of it (an execution left running by a previous process: already running,
        so no gate is asked). ``on_result``: see :meth:`execute`."""
        self._check_open()
        verdict = ALLOW
        if settle is None:
            asked = ExecutionRequest(code, source, "", timeout, tag, silent, _utcnow(), shell)
            verdict = await self._admit(asked)
            if verdict.refusal is not None:
                result = refused_result(verdict.refusal, verdict.findings, asked.started_at)
                return await self._finish(asked, result, on_result, notes=False)
        async with self._lock:
            if holding is not None:
                holding.set()
            self._check_open()
            ended = self._execution_ended = asyncio.Event()
            try:
                await self._note_discarded()
                try:
                    with self._kernel.drain.reading():
                        request, result = await self._execute_locked(
                            code, timeout, send, replies, on_output, tag, source, silent, shell
                        )
                except (Exception, asyncio.CancelledError) as err:
                    # Shut down under the execution past its grace: its sockets closed (a read
                    # cancelled by its socket's close is not this task being cancelled): say so.
                    if self._closed and not _cancelling():
                        raise SessionClosedError(f"session {self.id} was shut down during the execution") from err
                    raise
                finally:
                    self._running = None
                if verdict.findings:
                    result = dataclasses.replace(result, policy=verdict.findings)
                if settle is not None:
                    result = settle(result)
                return await self._finish(request, result, on_result, notes=True)
            finally:
                ended.set()

    async def _finish(
        self,
        request: ExecutionRequest,
        result: ExecutionResult,
        on_result: Callable[[ExecutionResult], None] | None,
        notes: bool,
    ) -> ExecutionResult:
        """Hand ``result`` to the door (``on_result``), then tell the observers; then the notes
        (``notes``: only under the execute lock, where a restart's notes belong to this execution)."""
        answer_failed: BaseException | None = None
        if on_result is not None:
            try:
                on_result(result)
            except Exception as err:  # the execution happened all the same: it is recorded first
                answer_failed = err
        await self.observers.emit("execution_finished", request, result)
        if notes:
            await self._flush_notes()
        await self._run_after_execution()
        if answer_failed is not None:
            raise answer_failed
        return result

    async def _execute_locked(
        self,
        code: str,
        timeout: float,
        send: Callable[[], str],
        replies: ReplySource,
        on_output: OutputCallback | None,
        tag: str | None,
        source: str,
        silent: bool,
        shell: str | None,
    ) -> tuple[ExecutionRequest, ExecutionResult]:
        await self._restart_settled()
        if not await self._kernel.is_alive_unchanged():
            status = await self._deaths.classify(self.container, None)
            await self._restart_after_death(status, between_executes=True)
        state_lost, self._pending_state_lost = self._pending_state_lost, None
        oom_before = await self._deaths.baseline(self.container)
        meter = self.meter
        if meter is not None:
            await meter.start()
        started_at, t0 = _utcnow(), time.monotonic()
        epoch = self._kernel.epoch
        self._interrupt_requested = False
        msg_id = send()
        request = ExecutionRequest(code, source, msg_id, timeout, tag, silent, started_at, shell)
        self._running = request
        await self.observers.emit("execution_started", request)
        collector = OutputCollector(self._output_callback(request, on_output))
        watch = ExecutionWatch(
            self._kernel,
            msg_id,
            collector,
            replies,
            lambda: self._interrupt_requested,
            lambda: self._detaching or self._closed,
        )
        status = await watch.until_idle(t0 + timeout, epoch)
        ended_by: TimeoutStep | None = None
        if status is ExecutionStatus.DETACHED and not self._detaching:
            status = ExecutionStatus.DELETED  # shut down under it (see shutdown)
        elif status is ExecutionStatus.DETACHED:
            ended_by = TimeoutStep.GATEWAY_RESTART
        elif status is ExecutionStatus.TIMEOUT:
            ended_by = await self._stop_runaway(watch, timeout)
        elif status is ExecutionStatus.KERNEL_DIED and epoch == self._kernel.epoch:
            status = await self._deaths.classify(self.container, oom_before)
            await self._restart_after_death(status, between_executes=False)
        elif status is ExecutionStatus.KERNEL_DIED:
            # Restarted under it by a caller (only a restart asked for runs beside an execution):
            # once the restart is over, its reason (who asked) is this execution's state_lost.
            await self._restart_settled()
            status = ExecutionStatus.RESTARTED
        elif status is ExecutionStatus.OK:
            status = await watch.reply_status()
        # A restart during this execution is reported now and again by the next one.
        state_lost = self._pending_state_lost or state_lost
        duration = round(time.monotonic() - t0, 6)
        accounting = await meter.finish(duration) if meter is not None else None
        result = ExecutionResult(
            status=status,
            outputs=collector.finished_outputs(),
            execution_count=collector.execution_count,
            started_at=started_at,
            duration=duration,
            error=collector.error,
            ended_by=ended_by,
            state_lost=state_lost,
            chars_cut=collector.chars_cut,
            outputs_dropped=collector.outputs_dropped,
            bytes_omitted=collector.bytes_omitted,
            accounting=accounting,
        )
        return request, result

    def _output_callback(self, request: ExecutionRequest, on_output: OutputCallback | None) -> OutputCallback | None:
        """The collector's callback: the caller's streaming callback, then the observers."""
        if on_output is None and not self.observers:
            return None

        async def deliver(output: dict[str, Any]) -> None:
            if on_output is not None:
                await on_output(output)
            await self.observers.emit("output_received", request, output)

        return deliver

    async def _restart_after_death(self, status: ExecutionStatus, between_executes: bool) -> None:
        """Restart a kernel that died; when the new one does not come up, replace the container.

        A kernel can die of what stays in its container: a tmpfs workspace holding nearly all of
        the memory limit (tmpfs pages are never reclaimed) leaves no room for a new kernel,
        which is then killed before it answers. Without the last rung the session would be
        left with no kernel at all."""
        await self._restart_or_replace(
            self._deaths.sentence(status, between_executes),
            self._deaths.sentence(status, between_executes, ended="and its restart did not come up")
            + ", so the container was replaced",
        )

    async def _restart_or_replace(self, restarted: str, replaced: str | None) -> TimeoutStep:
        """Restart the kernel (``restarted`` is what the caller is told); if it does not come
        up in time, replace the container (told ``replaced``; None: raise instead): the last
        two rungs of the ladder.

        One restart at a time, whoever asks (a client, the timeout ladder, a death): a call while
        one is under way joins it and gets its outcome, so two restarts never drive the kernel
        manager at once; a caller that would replace the container goes on to do so when the
        restart it joined could not. The restart is a task of its own, shielded from its
        callers: a caller that goes away (a client gone, a request's timeout) never leaves a
        kernel half-started."""
        while (task := self._restarting) is not None and not task.done():
            replaces = self._restart_replaces
            try:
                return await asyncio.shield(task)
            except (asyncio.TimeoutError, SandkernelError, RuntimeError):
                if replaced is None or replaces:
                    raise
        task = self._restarting = asyncio.create_task(self._restart_ladder(restarted, replaced))
        self._restart_replaces = replaced is not None
        task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    async def _restart_ladder(self, restarted: str, replaced: str | None) -> TimeoutStep:
        """See :meth:`_restart_or_replace`: the task every caller of one restart waits on."""
        if replaced is None:
            return await self._restart_kernel(restarted)
        try:
            return await asyncio.wait_for(
                self._restart_kernel(restarted), timeout=self.profile.start_timeout + self.profile.interrupt_grace
            )
        except (asyncio.TimeoutError, SandkernelError, RuntimeError) as err:
            log.warning("restart failed, replacing the container: %s", err, extra={"session": self.id})
            await self._replace_kernel(replaced)
            return TimeoutStep.KILL

    async def _restart_settled(self) -> None:
        """Return once no restart is under way (its failure is its callers' to report)."""
        task = self._restarting
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def _stop_runaway(self, watch: ExecutionWatch, timeout: float) -> TimeoutStep:
        """The ladder: interrupt, wait the grace period, restart the kernel, replace the container."""
        grace = self.profile.interrupt_grace
        reason = f"execution exceeded its {timeout:g}s timeout"
        with contextlib.suppress(RuntimeError, SandkernelError):
            await self._kernel.interrupt()
            epoch = self._kernel.epoch
            if await watch.until_idle(time.monotonic() + grace, epoch) is ExecutionStatus.OK:
                await watch.reply_status()
                log.info("timeout ended by interrupt", extra={"session": self.id})
                return TimeoutStep.INTERRUPT
        step = await self._restart_or_replace(
            f"the kernel was restarted because the {reason}", f"the container was replaced because the {reason}"
        )
        log.info("timeout ended by %s", step.value, extra={"session": self.id})
        return step

    async def _replace_kernel(self, reason: str) -> None:
        """Last rung: throw away the kernel manager and container, start from scratch."""
        kept = await self._kernel.replace()
        self._deaths.forget_container()
        self._pending_state_lost = reason + (
            "; variables and imports are gone, /workspace files are kept"
            if kept
            else "; variables, imports and /workspace files are gone"
        )
        self._notes.append(self._pending_state_lost)
        await self.observers.emit("kernel_restarted", reason, True)
