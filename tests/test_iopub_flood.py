"""A kernel whose output nobody reads for a while survives its own flood (kernel-image/iopub_budget.py).

A thread of the tenant's code keeps displaying 30 MB blobs, 900 MB in all, while the host reads
nothing: the test blocks its own event loop, where the session's iopub reader runs, as a loaded
machine or a stalled client would. Before the byte bound the kernel queued every message for the
host (ZMQ's queue is 64 messages, whatever their size) and was killed for memory in its 512 MiB
sandbox; with it, the kernel keeps at most the budget and drops the rest, and the session carries
on with its state.
"""

from __future__ import annotations

import time

import pytest

from sandkernel.kernels.execution.outputs import ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.docker_engine import default_engine

from .conftest import RUNTIME_PARAMS, require_runtime

pytestmark = pytest.mark.docker

BLOB_BYTES = 30_000_000
MESSAGES = 30  # 900 MB of output against a 512 MiB sandbox
DONE_FILE = "/workspace/flood-done"
# How long the flooder may take to send everything while the host reads nothing: each message is a
# JSON encoding and an HMAC of 30 MB, a fraction of a second each on a quiet machine.
FLOOD_BOUND_SECONDS = 240

FLOOD = f"""
import os, threading
from IPython.display import display
blob = 'x' * {BLOB_BYTES}
def flood():
    for _ in range({MESSAGES}):
        display({{'text/plain': blob}}, raw=True)
    open({DONE_FILE!r}, 'w').close()
flooder = threading.Thread(target=flood, daemon=True)
flooder.start()
"""


def wait_for_file_without_the_loop(container_id: str, path: str, bound: float) -> bool:
    """Poll for ``path`` in the container with blocking Docker calls, so the event loop (and the
    session's iopub reader with it) stays stopped meanwhile. False when the bound passed first."""
    container = default_engine().client.containers.get(container_id)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if container.exec_run(["test", "-e", path]).exit_code == 0:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.docker
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_flood_nobody_reads_does_not_kill_the_kernel(runtime):
    require_runtime(runtime)
    session = await KernelSession.start(overrides={"runtime": runtime, "memory_mb": 512, "pids": 128, "cpus": 1.0})
    try:
        started = await session.execute(FLOOD, timeout=60)
        assert started.status is ExecutionStatus.OK, started.outputs
        flooded = wait_for_file_without_the_loop(session.container.id, DONE_FILE, FLOOD_BOUND_SECONDS)
        after = await session.execute("flooder.join()\nprint(flooder.is_alive(), len(blob))", timeout=60)
        assert after.status is ExecutionStatus.OK, f"{after.status}: the kernel did not survive the flood"
        assert after.text.endswith("False 30000000\n"), after.text
        assert flooded, f"the flooder did not finish within {FLOOD_BOUND_SECONDS} s"
    finally:
        await session.shutdown()
