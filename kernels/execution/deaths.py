"""Why a kernel died: out of memory, or something else, told apart by the container's counters.

Under gVisor the whole sandbox dies on an OOM kill (Docker's ``OOMKilled``); under runc only the
kernel process is killed and the container lives on, so the memory cgroup's ``oom_kill`` counter
is compared with its value before the execution. The counter is read once per container (not
on every execute) and again only after a death.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sandkernel.errors import SandkernelError
from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.sandbox.container import SandboxContainer

log = logging.getLogger(__name__)

# Seconds Docker may take to record the stop of a container whose cgroup is already gone (its
# verdict on OOM comes with the stop). On a loaded host that took over 3 s (a fixed 3 s wait
# called gVisor OOMs plain deaths); only a container the engine never sees stop waits it out.
ENGINE_STOP_TIMEOUT = 30.0
# Seconds an OOM event may follow the container's exit event (the shim sends them separately).
LATE_OOM_EVENT_SECONDS = 5.0


class DeathClassifier:
    """Classifies kernel deaths of one session's container(s) as OOM or KERNEL_DIED."""

    def __init__(self, memory_mb: int) -> None:
        self.memory_mb = memory_mb
        self._baseline: int | None = None

    def forget_container(self) -> None:
        """The container was replaced: its counters start again."""
        self._baseline = None

    async def baseline(self, container: SandboxContainer) -> int | None:
        """The OOM-kill count before an execution (read once per container)."""
        if self._baseline is None:
            self._baseline = await container.oom_kill_count()
        return self._baseline

    async def classify(self, container: SandboxContainer, before: int | None) -> ExecutionStatus:
        """KERNEL_DIED, or OOM when the container was OOM-killed or its counter moved past ``before``.

        Under gVisor the whole container dies; its memory cgroup goes with it, and Docker may not
        have recorded ``OOMKilled`` yet when the kernel's death is seen. So when the counter can
        no longer be read, Docker's verdict is awaited until it has recorded the stop (never
        under runc, whose container and cgroup outlive the kernel)."""
        try:
            if await container.oom_killed():
                return ExecutionStatus.OOM
            after = await container.oom_kill_count()
            if after is None and await self._settled_oom_kill(container):
                return ExecutionStatus.OOM
        except SandkernelError:
            return ExecutionStatus.KERNEL_DIED
        if after is not None and after > (before if before is not None else 0):
            self._baseline = after
            return ExecutionStatus.OOM
        # What the verdict rests on, for the rare death that was an OOM after all (seen once in
        # a loaded parallel test run under gVisor, not reproduced since).
        state = await container.engine_state()
        log.warning(
            "kernel died, not for memory as far as the engine and cgroup tell: engine state %s, "
            "OOMKilled %s, exit code %s; cgroup oom_kill count %s (before the execution: %s)",
            state and state.get("Status"),
            state and state.get("OOMKilled"),
            state and state.get("ExitCode"),
            after,
            before,
            extra={"container": container.id[:12]},
        )
        return ExecutionStatus.KERNEL_DIED

    @staticmethod
    async def _settled_oom_kill(container: SandboxContainer) -> bool:
        """Whether Docker, once it has recorded the container's stop, says it was killed for memory."""
        deadline = time.monotonic() + ENGINE_STOP_TIMEOUT
        while (state := await container.engine_state()) is not None and state.get("Running"):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        if not state:
            return False
        return await container.killed_for_memory(state, LATE_OOM_EVENT_SECONDS)

    def sentence(self, status: ExecutionStatus, between_executes: bool, ended: str = "and was restarted") -> str:
        """The state-loss sentence a result and the transcript carry; ``ended`` says what followed."""
        when = "between executions" if between_executes else "during this execution"
        if status is ExecutionStatus.OOM:
            return f"the kernel ran out of memory (limit {self.memory_mb} MiB) {when} {ended}"
        return f"the kernel died {when} {ended}"
