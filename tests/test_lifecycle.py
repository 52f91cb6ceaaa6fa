"""Timeouts that stop the code, OOM and crashes reported as such, restart semantics, no leaks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from sandkernel.kernels.execution.outputs import ExecutionStatus, TimeoutStep
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.reaper import reap
from sandkernel.kernels.sandbox.docker_engine import default_engine

from .conftest import RUNTIME_PARAMS, container_ids_of, require_runtime

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module", params=RUNTIME_PARAMS)
async def fast_ladder(request):
    """A session with a short ladder; the grace is long enough for a loaded gVisor host to answer an interrupt."""
    require_runtime(request.param)
    s = await KernelSession.start(overrides={"runtime": request.param, "interrupt_grace": 5.0, "memory_mb": 256})
    yield s
    await s.shutdown()


@pytest.mark.parametrize(
    ("code", "steps"),
    [
        ("while True: pass", {TimeoutStep.INTERRUPT}),
        ("import time; time.sleep(10**6)", {TimeoutStep.INTERRUPT}),
        # Catastrophic backtracking runs in C holding the GIL: only a restart can stop it.
        ("import re; re.match(r'(a*)*b', 'a' * 64)", {TimeoutStep.RESTART, TimeoutStep.KILL}),
    ],
    ids=["python-loop", "sleep", "c-loop"],
)
async def test_timeouts_stop_the_code(fast_ladder, code, steps):
    session = fast_ladder
    await session.execute("marker = 'alive'; open('/workspace/keep.txt', 'w').write('kept')", timeout=30)
    result = await session.execute(code, timeout=2)
    assert result.status is ExecutionStatus.TIMEOUT
    assert result.ended_by in steps
    # Bounded: timeout + grace, plus one kernel restart when the interrupt could not stop it.
    bound = (
        2 + session.profile.interrupt_grace + (session.profile.start_timeout if result.ended_by != "interrupt" else 2)
    )
    assert result.duration < bound
    after = await session.execute(
        "print(open('/workspace/keep.txt').read()); print(globals().get('marker'))", timeout=30
    )
    assert after.status is ExecutionStatus.OK
    if result.ended_by is TimeoutStep.INTERRUPT:
        assert after.text == "kept\nalive\n" and after.state_lost is None
    else:
        assert "restarted because the execution exceeded its 2s timeout" in result.state_lost
        assert after.state_lost == result.state_lost  # the next execute reports it too
        assert after.text.endswith("None\n")


async def test_memory_bomb_is_oom_and_next_execute_works(fast_ladder):
    session = fast_ladder
    await session.execute("x = 1", timeout=30)
    result = await session.execute("b = bytearray(2 * 1024**3)", timeout=60)
    assert result.status is ExecutionStatus.OOM
    assert "ran out of memory (limit 256 MiB)" in result.state_lost
    after = await session.execute("print(globals().get('x'))", timeout=30)
    assert after.status is ExecutionStatus.OK and after.text == "None\n"
    assert "ran out of memory" in after.state_lost
    assert (await session.execute("print('fresh')", timeout=30)).state_lost is None


async def test_kernel_death_is_reported(fast_ladder):
    session = fast_ladder
    result = await session.execute("import os; os._exit(3)", timeout=30)
    assert result.status is ExecutionStatus.KERNEL_DIED
    after = await session.execute("print('back')", timeout=30)
    assert after.text == "back\n" and "died" in after.state_lost


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_restart_keeps_files_drops_memory_and_stray_processes(runtime):
    require_runtime(runtime)
    async with await KernelSession.start(overrides={"runtime": runtime}) as s:
        await s.execute(
            "import subprocess\nsecret_var = 1\nopen('data.txt', 'w').write('persist')\n"
            "subprocess.Popen(['sleep', '1000'], start_new_session=True)",
            timeout=30,
        )
        before = await s.execute(
            "import subprocess; print(subprocess.run(['ps', '-eo', 'comm'], capture_output=True, text=True).stdout)",
            timeout=30,
        )
        assert "sleep" in before.text
        container = s.container.id
        await s.restart()
        assert s.container.id == container
        result = await s.execute(
            "import subprocess\nprint(open('data.txt').read(), 'secret_var' in globals())\n"
            "print(subprocess.run(['ps', '-eo', 'comm'], capture_output=True, text=True).stdout)",
            timeout=30,
        )
        assert result.text.startswith("persist False\n")
        assert "sleep" not in result.text, "a process left by the old kernel survived the restart"
        assert "restarted on request" in result.state_lost


async def test_an_unanswered_start_says_whether_the_kernel_runs_and_which_channel_reached_it():
    """What a start that timed out adds to its error (and log): a kernel that answers, and the
    same kernel stopped (SIGSTOP) so that nothing reaches it, are told apart, with its log."""
    s = await KernelSession.start()
    kernel = s._kernel
    try:
        with kernel.drain.reading():  # the probe's replies are ours to read, not the idle drain's
            answering = await kernel._what_an_unanswered_start_saw()
            await kernel.container.signal_kernel(signal.SIGSTOP)
            try:
                stopped = await kernel._what_an_unanswered_start_saw()
            finally:
                await kernel.container.signal_kernel(signal.SIGCONT)
    finally:
        await s.shutdown()
    assert re.match(r"kernel process running; a last probe: iopub answered, [1-9]\d* shell replies waiting", answering)
    assert stopped.startswith("kernel process running; a last probe: iopub silent, 0 shell replies waiting"), stopped
    assert "kernel log: " in stopped and "no more known" not in stopped, stopped


async def test_shutdown_removes_container_and_runtime_dir():
    s = await KernelSession.start()
    rundir = s.provisioner.runtime_dir.path
    assert container_ids_of(s.id) and rundir.exists()
    await s.shutdown()
    assert container_ids_of(s.id) == [] and not rundir.exists()
    await s.shutdown()  # idempotent


async def test_reaper_removes_containers_of_a_crashed_process():
    """A process that dies by SIGKILL cannot clean up; the reaper removes what it left."""
    script = textwrap.dedent(
        """
        import asyncio, json, os, signal
        from sandkernel.kernels.execution.session import KernelSession
        async def main():
            s = await KernelSession.start()
            print(json.dumps({"session": s.id, "rundir": str(s.provisioner.runtime_dir.path)}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        asyncio.run(main())
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = json.loads(proc.stdout.strip().splitlines()[-1])
    assert container_ids_of(left["session"]), "the crashed process should have left its container"
    report = await reap(default_engine())
    assert any(left["session"][:12] in name for name in report.removed)
    assert container_ids_of(left["session"]) == []
    assert not os.path.exists(left["rundir"])
