"""Watching one running execution: its outputs, its end, its reply, a dead kernel.

The kernel's iopub carries the execution's outputs and, last, its ``idle`` status; a watchdog
checks the kernel between messages; the ``execute_reply`` (from the session's own shell or a
door's relay, see replies.py) gives the final status and execution count. When iopub fell silent
although the reply came (a flood dropped the idle, or an oversized message cut the subscription)
the subscription is probed and renewed, and the result says output was lost.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from sandkernel.kernels.execution.kernel import SandboxedKernel
from sandkernel.kernels.execution.outputs import ExecutionStatus, OutputCollector
from sandkernel.kernels.execution.replies import ReplySource
from sandkernel.kernels.execution.transport import MAX_MESSAGE_BYTES

# How often a silent execution checks that its kernel is still alive (seconds).
WATCHDOG_INTERVAL = 0.5
# How long iopub may lag behind a reply that already arrived before the subscription is taken
# for cut and renewed (seconds). The kernel publishes outputs from a thread of its own: starved
# of CPU (another tenant's attack on a 2-core host, gVisor), it can trail the shell reply by
# seconds, and renewing the subscription then would drop the very outputs that were on the way.
IOPUB_PROBE_SECONDS = 10.0
# How long to wait for the execute_reply once the kernel went idle (seconds).
REPLY_TIMEOUT = 5.0

# Added to an execution whose outputs were cut off with the iopub subscription.
OUTPUT_LOST_NOTE = {
    "header": {"msg_type": "stream"},
    "parent_header": {},
    "content": {
        "name": "stderr",
        "text": f"[sandkernel: output lost: the kernel sent a message over the {MAX_MESSAGE_BYTES // 2**20} MiB "
        "transport limit; the output channel was reconnected]\n",
    },
}


class ExecutionWatch:
    """The watch over one sent execute request ``msg_id``; outputs go to ``collector``."""

    def __init__(
        self,
        kernel: SandboxedKernel,
        msg_id: str,
        collector: OutputCollector,
        replies: ReplySource,
        interrupt_requested: Callable[[], bool],
        detached: Callable[[], bool] = lambda: False,
    ) -> None:
        """``detached`` says the gateway is letting go of the session: the watch ends at once."""
        self.kernel = kernel
        self.msg_id = msg_id
        self.collector = collector
        self.replies = replies
        self._interrupt_requested = interrupt_requested
        self._detached = detached

    async def until_idle(self, deadline: float, epoch: int) -> ExecutionStatus:
        """Feed the execution's iopub messages to the collector until the kernel is idle.

        Returns OK (idle seen), TIMEOUT (``deadline``, monotonic, passed), KERNEL_DIED (the
        kernel is dead, or was restarted since ``epoch``) or DETACHED (the gateway let go)."""
        while True:
            if self._detached():
                return ExecutionStatus.DETACHED
            if epoch != self.kernel.epoch:
                # Restarted under us (a restart request does not wait for the execute lock): leave
                # iopub to the restart's readiness probe at once, or this loop would consume the
                # probe's answers, as it consumes every message, until the restart timed out.
                return ExecutionStatus.KERNEL_DIED
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ExecutionStatus.TIMEOUT
            try:
                msg = await self.kernel.read("iopub", min(remaining, WATCHDOG_INTERVAL))
            except queue.Empty:
                if epoch != self.kernel.epoch or not await self.kernel.is_alive():
                    return ExecutionStatus.KERNEL_DIED
                if await self.replies.poll(self.msg_id) is not None:
                    # The reply is final but iopub never said idle: dropped under flood, or the
                    # subscription itself was cut (an oversized message). Check, and repair.
                    answered = await self.kernel.iopub_answers(
                        IOPUB_PROBE_SECONDS, self.msg_id, self.collector, on_end=self.replies.ended_on_iopub
                    )
                    if not answered:
                        await self.kernel.reconnect_iopub()
                        await self.collector.add(OUTPUT_LOST_NOTE)
                    return ExecutionStatus.OK
                continue
            if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
                continue
            if msg["header"]["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return ExecutionStatus.OK
            await self.collector.add(msg)

    async def reply_status(self) -> ExecutionStatus:
        """Read the execute_reply and classify the outcome: OK, ERROR or INTERRUPTED."""
        reply = await self.replies.wait(self.msg_id, REPLY_TIMEOUT)
        collector = self.collector
        if reply is not None and reply.get("execution_count") is not None:
            collector.execution_count = reply["execution_count"]
        failed = (reply or {}).get("status") == "error" or collector.error is not None
        if not failed:
            return ExecutionStatus.OK
        # A second SIGINT landing in IPython's handling of the first leaves no error output (IPython
        # prints a bare "KeyboardInterrupt" to stderr): the reply still names the exception.
        name = collector.error.name if collector.error is not None else (reply or {}).get("ename")
        if self._interrupt_requested() and name == "KeyboardInterrupt":
            return ExecutionStatus.INTERRUPTED
        return ExecutionStatus.ERROR
