"""A cell a previous gateway process left running, ending while the next one watches it
(kernels/execution/replies.py ``OrphanReply``): its reply went to the dead process, so a
kernel_info request sent behind it stands in. The stand-in can reach the shell before the cell's
idle reaches iopub (gVisor; more so a savable sandbox's relay on a loaded host: seen in a run of
the runsc tests with memory snapshots on, where such a cell was settled ``detached``). A cell
whose idle then comes was seen to end; only one whose idle never comes ended unseen.

Pure: the real watch, the real iopub probe (``SandboxedKernel.iopub_answers``) and the real
OrphanReply, over scripted channel reads, since the order of two sockets cannot be forced.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from sandkernel.kernels.execution.kernel import SandboxedKernel
from sandkernel.kernels.execution.outputs import ExecutionStatus, OutputCollector
from sandkernel.kernels.execution.replies import OrphanReply
from sandkernel.kernels.execution.watch import ExecutionWatch

CELL, STAND_IN, PROBE = "the-orphaned-cell", "the-stand-in", "the-iopub-probe"
NOTHING_YET = object()  # a read that finds nothing (queue.Empty)


class ScriptedKernel:
    """What the watch and the iopub probe touch, each read taking the next scripted message."""

    epoch = 0

    def __init__(self, iopub: list[Any], shell: list[Any]) -> None:
        self.scripts = {"iopub": iopub, "shell": shell}
        self.client = self

    def kernel_info(self) -> str:  # the iopub probe's request
        return PROBE

    async def read(self, channel: str, timeout: float) -> dict[str, Any]:
        script = self.scripts[channel]
        if not script or script[0] is NOTHING_YET:
            if script:
                script.pop(0)
            raise queue.Empty
        return script.pop(0)

    async def is_alive(self) -> bool:
        return True

    async def iopub_answers(self, *args: Any, **kwargs: Any) -> bool:
        return await SandboxedKernel.iopub_answers(self, *args, **kwargs)  # type: ignore[arg-type]

    async def reconnect_iopub(self) -> None:
        raise AssertionError("iopub answered the probe: nothing to reconnect")


def status(parent: str) -> dict[str, Any]:
    return {"parent_header": {"msg_id": parent}, "header": {"msg_type": "status"}, "content": {"execution_state": "idle"}}


async def watch(iopub: list[Any]) -> tuple[ExecutionStatus, OrphanReply]:
    kernel = ScriptedKernel(iopub, [{"parent_header": {"msg_id": STAND_IN}, "content": {}}])
    replies = OrphanReply(lambda timeout: kernel.read("shell", timeout))
    replies.probe_id = STAND_IN
    ended = await ExecutionWatch(kernel, CELL, OutputCollector(), replies, lambda: False).until_idle(
        time.monotonic() + 30, 0
    )
    return ended, replies


async def test_a_cell_whose_idle_trails_the_stand_in_was_seen_to_end():
    ended, replies = await watch([NOTHING_YET, status(CELL), status(PROBE)])
    assert ended is ExecutionStatus.OK and not replies.ended_unseen


async def test_a_cell_whose_idle_never_comes_ended_unseen():
    ended, replies = await watch([NOTHING_YET, status(PROBE)])
    assert ended is ExecutionStatus.OK and replies.ended_unseen
