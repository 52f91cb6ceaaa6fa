"""Re-adopting a sandbox whose process died: state kept, checks before trust, executions settled.

A child process starts a session and dies with ``os._exit`` (no clean-up runs, as after
``kill -9``); this process adopts the sandbox from the child's durable state, as a restarted
gateway does from its catalog.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandkernel.errors import AdoptionRefusedError, SandboxLostError, SessionDetachedError
from sandkernel.kernels.execution.events import SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionStatus, TimeoutStep
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label
from sandkernel.kernels.sandbox.state_dir import state_dir
from sandkernel.kernels.sandbox.workspace_disk import WorkspaceDisk

from .conftest import RUNTIME_PARAMS, container_ids_of, require_runtime
from .test_egress import Upstream, policy_for

pytestmark = pytest.mark.docker

CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from sandkernel.kernels.execution.events import SessionObserver
    from sandkernel.kernels.execution.session import KernelSession
    from sandkernel.kernels.sandbox import labels

    # The sandbox is labelled as the test process's, which outlives this child: the reaper of any
    # gateway another test starts meanwhile (a parallel run) must not take it before adoption.
    # A real crashed gateway's sandboxes are spared the same way by its catalog.
    # (The original is held apart: patching reaper first must not hide it from the others.)
    original = labels.owner_label
    for module in list(sys.modules.values()):
        if getattr(module, "owner_label", None) is original:
            module.owner_label = lambda: os.environ["SANDKERNEL_TEST_ORPHAN_OWNER"]

    class Started(SessionObserver):
        def __init__(self):
            self.event, self.request = asyncio.Event(), None
        async def execution_started(self, request):
            self.request = request
            self.event.set()

    async def main(overrides, out, left_running):
        s = await KernelSession.start(overrides={"memory_mb": 256, "workspace_mb": 64, **json.loads(overrides)})
        r = await s.execute("x = 42; open('/workspace/kept.txt', 'w').write('kept')")
        assert r.status.value == "ok", r
        started, running = Started(), None
        s.add_observer(started)
        if left_running:
            asyncio.ensure_future(s.execute(left_running, timeout=60))
            await started.event.wait()
            await asyncio.sleep(0.5)
            running = started.request.to_dict()
        with open(out, "w") as f:
            json.dump({"id": s.id, "state": s.durable_state(), "running": running}, f)
        os._exit(0)  # no clean-up at all, as after kill -9

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    """
)


class Recorded(SessionObserver):
    """What a transcript would get."""

    def __init__(self) -> None:
        self.finished: list = []
        self.notes: list[str] = []

    async def execution_finished(self, request, result) -> None:
        self.finished.append((request, result))

    async def note_added(self, text: str) -> None:
        self.notes.append(text)


async def orphaned_sandbox(tmp_path: Path, runtime: str, left_running: str = "", **overrides: object) -> dict:
    """Start a session in a child process that then dies without cleaning up; its record."""
    out = tmp_path / "record.json"
    settings = json.dumps({"runtime": runtime, **overrides})
    # The child keeps its workspace disk where this process will look for it.
    env = {**os.environ, "SANDKERNEL_STATE_DIR": str(state_dir()), "SANDKERNEL_TEST_ORPHAN_OWNER": owner_label()}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, settings, str(out), left_running, env=env)
    assert await asyncio.wait_for(proc.wait(), 180) == 0
    record = json.loads(out.read_text())
    owners = default_engine().client.containers.list(all=True, sparse=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"})
    assert record["state"]["container_id"] in {c.id for c in owners}, "the orphan does not carry this process's owner label"
    return record


async def adopted(record: dict) -> tuple[KernelSession, Recorded]:
    session = await KernelSession.adopt(record["id"], record["state"])
    recorded = Recorded()
    session.add_observer(recorded)
    await session.resume(running=record["running"], detached_at="the child's death")
    return session, recorded


@pytest.fixture(params=RUNTIME_PARAMS)
def runtime(request):
    require_runtime(request.param)
    return request.param


async def test_an_adopted_sandbox_keeps_its_variables_and_files(tmp_path, runtime):
    record = await orphaned_sandbox(tmp_path, runtime)
    session, recorded = await adopted(record)
    try:
        assert session.id == record["id"] and session.kernel_id == record["state"]["kernel_id"]
        assert any("no gateway was attached" in note for note in recorded.notes)
        result = await session.execute("print(x, open('/workspace/kept.txt').read())", timeout=60)
        assert result.status is ExecutionStatus.OK and result.text == "42 kept\n"
        # Everything works as on a session started here: interrupt, restart (files kept).
        result = await session.execute("while True: pass", timeout=3)
        assert result.status is ExecutionStatus.TIMEOUT
        await session.restart()
        result = await session.execute("print(open('/workspace/kept.txt').read())", timeout=60)
        assert result.text == "kept\n"
    finally:
        await session.shutdown()
    assert container_ids_of(record["id"]) == []


async def test_an_execution_left_running_is_settled_and_later_ones_queue_behind_it(tmp_path, runtime):
    code = "import time\nprint('before', flush=True)\ntime.sleep(6)\nprint('after')\ny = 7"
    record = await orphaned_sandbox(tmp_path, runtime, code)
    assert record["running"]["code"] == code
    session, recorded = await adopted(record)
    try:
        assert session.busy  # the settling holds the execute lock
        result = await session.execute("print(y)", timeout=60)  # runs only after the orphan ended
        assert result.status is ExecutionStatus.OK and result.text == "7\n"
        request, settled = recorded.finished[0]
        assert request.code == code and request.msg_id == record["running"]["msg_id"]
        assert settled.status is ExecutionStatus.OK and "after" in settled.text
        assert "before" not in settled.text  # printed while no one was attached: missing, not invented
        assert settled.started_at == record["running"]["started_at"]
    finally:
        await session.shutdown()


async def ended_unwatched(session_id: str, marker: str, bound: float = 120) -> None:
    """Wait (no process attached) until the orphaned cell wrote its last line's marker, then a
    second more for its reply to go out: the adopter must find it ended, however loaded the machine."""
    (container_id,) = container_ids_of(session_id)
    container = default_engine().client.containers.get(container_id)
    deadline = time.monotonic() + bound
    while (await asyncio.to_thread(container.exec_run, ["test", "-e", marker])).exit_code != 0:
        assert time.monotonic() < deadline, f"the orphaned cell did not end within {bound} s"
        await asyncio.sleep(0.2)
    await asyncio.sleep(1)


async def test_an_execution_that_ended_unwatched_is_recorded_as_such(tmp_path, runtime):
    record = await orphaned_sandbox(tmp_path, runtime, "import time; time.sleep(1); z = 1; open('/tmp/ended', 'w').close()")
    await ended_unwatched(record["id"], "/tmp/ended")
    session, recorded = await adopted(record)
    try:
        await session.wait_idle()
        _, settled = recorded.finished[0]
        assert settled.status is ExecutionStatus.DETACHED and settled.ended_by is TimeoutStep.GATEWAY_RESTART
        assert (await session.execute("print(z)", timeout=60)).text == "1\n"
    finally:
        await session.shutdown()


async def test_an_execution_left_running_still_meets_its_timeout(tmp_path, runtime):
    record = await orphaned_sandbox(tmp_path, runtime, "while True: pass")
    record["running"]["timeout"] = 2  # recorded before the restart: the ladder applies after it
    session, recorded = await adopted(record)
    try:
        await asyncio.wait_for(session.wait_idle(), 60)
        _, settled = recorded.finished[0]
        assert settled.status is ExecutionStatus.TIMEOUT
        assert (await session.execute("print('free')", timeout=60)).text == "free\n"
    finally:
        await session.shutdown()


async def test_cut_and_detach_leave_the_sandbox_running_for_the_next_process(tmp_path, runtime):
    record = await orphaned_sandbox(tmp_path, runtime)
    session, _ = await adopted(record)
    state = session.durable_state()
    running = asyncio.ensure_future(session.execute("import time; time.sleep(5); w = 5", timeout=60))
    while session.running_request is None:
        await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(session.execute("print('queued')", timeout=60))
    await asyncio.sleep(0.2)
    await session.cut_running()
    result = await running
    assert result.status is ExecutionStatus.DETACHED and result.ended_by is TimeoutStep.GATEWAY_RESTART
    with pytest.raises(SessionDetachedError) as refused:
        await queued
    assert refused.value.http_status == 503
    await session.detach()
    assert container_ids_of(record["id"])  # still there
    again, _ = await adopted({"id": record["id"], "state": state, "running": None})
    try:
        await asyncio.sleep(5)
        assert (await again.execute("print(w, x)", timeout=60)).text == "5 42\n"
    finally:
        await again.shutdown()
    assert container_ids_of(record["id"]) == []


async def test_a_dead_container_is_lost_with_the_reason_and_discard_clears_it(tmp_path, runtime):
    record = await orphaned_sandbox(tmp_path, runtime)
    state = record["state"]
    engine = default_engine()
    await engine.run(engine.client.api.kill, state["container_id"], "SIGKILL")
    with pytest.raises(SandboxLostError) as lost:
        await KernelSession.adopt(record["id"], state)
    assert "exit code" in str(lost.value) and lost.value.http_status == 410
    await KernelSession.discard(record["id"], state)
    assert container_ids_of(record["id"]) == []
    assert not os.path.exists(state["runtime_dir"])
    if state.get("workspace_disk"):
        disk = WorkspaceDisk.from_dict(state["workspace_disk"])
        assert not disk.image.exists() and not disk.mount_point.exists()
    with pytest.raises(SandboxLostError, match="removed"):
        await KernelSession.adopt(record["id"], state)


async def test_a_sandbox_that_is_not_what_was_recorded_is_refused_and_left_alone(tmp_path, runtime):
    record = await orphaned_sandbox(tmp_path, runtime)
    state = record["state"]
    try:
        for field, value in (("image_id", "sha256:" + "0" * 64), ("kernel_id", "another-kernel")):
            with pytest.raises(AdoptionRefusedError):
                await KernelSession.adopt(record["id"], dict(state, **{field: value}))
        # A recorded path outside the runtime base is never followed nor removed.
        with pytest.raises(AdoptionRefusedError):
            await KernelSession.adopt(record["id"], dict(state, runtime_dir="/etc"))
        # An entry planted in the runtime dir (it is locked: only a root on the host could).
        planted = Path(state["runtime_dir"]) / "planted"
        planted.write_text("x")
        with pytest.raises(AdoptionRefusedError, match="unexpected entries"):
            await KernelSession.adopt(record["id"], state)
        assert planted.exists() and container_ids_of(record["id"])  # left alone for an operator
        planted.unlink()
        session = await KernelSession.adopt(record["id"], state)
        await session.shutdown()
    finally:
        await KernelSession.discard(record["id"], state)
    assert container_ids_of(record["id"]) == []


async def test_an_adopted_sandbox_reaches_its_allowed_hosts_through_a_new_proxy(tmp_path, runtime):
    upstream = await Upstream().start()
    try:
        record = await orphaned_sandbox(tmp_path, runtime, network=policy_for(upstream))
        session, _ = await adopted(record)
        try:
            fetch = f"import urllib.request\nprint(urllib.request.urlopen('http://allowed.test:{upstream.http_port}/hi').read().decode())"
            result = await session.execute(fetch, timeout=60)
            assert result.status is ExecutionStatus.OK and result.text == "hello from upstream\n", result
            assert [r["verdict"] for r in session.egress_records()] == ["allowed"]  # audited by the new proxy
        finally:
            await session.shutdown()
    finally:
        upstream.close()
