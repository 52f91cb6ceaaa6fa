"""A tenant that stops its own archiver holds up no one else (issue 30, item 8).

The culler paused idle sessions one at a time, each for up to --pause-timeout (600 s), and a
tenant can SIGSTOP the ``tar`` a pause runs in its sandbox: twenty idle sessions held lifetime
and TTL enforcement for hours, and a stopping gateway waited on them. Idle pauses now run in the
background, a few at once, each within --pause-timeout, after which the session is deleted (the
audit says why); a stopping gateway cancels them."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from sandkernel.gateway.audit import chain
from sandkernel.gateway.stop_watch import STOP_MARGIN_SECONDS
from sandkernel.kernels.sandbox.docker_engine import default_engine

from ..conftest import RUNTIME_PARAMS, container_ids_of, require_runtime
from ..gateway_fixtures import BOB, start_gateway, stop_gateway
from ..test_audit import records
from ..test_durable_sessions import Serve
from .test_frozen_helpers import FREEZE_EVERY_NEW_PROCESS

pytestmark = [pytest.mark.security, pytest.mark.docker]

# Tenant code: 32 MiB of files (tar takes a moment over them), and a thread that stops every
# tar the gateway starts in this sandbox (the sandbox's user runs both: it may).
STOP_MY_TAR = """
import os, signal, threading, time
os.makedirs('/workspace/data', exist_ok=True)
for i in range(32):
    with open(f'/workspace/data/{i}', 'wb') as f:
        f.write(os.urandom(2**20))
def stop_tar():
    while True:
        for pid in os.listdir('/proc'):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    with open(f'/proc/{pid}/comm') as f:
                        if f.read().strip() == 'tar':
                            os.kill(int(pid), signal.SIGSTOP)
                except OSError:
                    pass
        time.sleep(0.002)
threading.Thread(target=stop_tar, daemon=True).start()
print('armed')
"""


async def execute(gw, sid: str, code: str, token: str | None = None) -> dict:
    kwargs = {"token": token} if token else {}
    status, reply = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": code}, **kwargs)
    assert status == 200 and reply["status"] == "ok", reply
    return reply


async def a_stopped_tar_in(container_id: str, timeout: float = 60.0) -> None:
    """Return once the container runs a stopped tar (ps state T), as the engine's top shows it."""
    container = await asyncio.to_thread(default_engine().client.containers.get, container_id)
    deadline = time.monotonic() + timeout
    while True:
        top = await asyncio.to_thread(container.top, ps_args="-eo pid,stat,comm")
        if any(row[1].startswith("T") and row[2] == "tar" for row in top.get("Processes") or []):
            return
        assert time.monotonic() < deadline, f"no stopped tar within {timeout:g} s: {top}"
        await asyncio.sleep(0.1)


async def state_of(gw, sid: str) -> str:
    status, model = await gw.request("GET", f"/api/sessions/{sid}")
    return model.get("state", "") if status == 200 else str(status)


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_stuck_idle_pause_holds_up_no_other_pause_and_ends_at_its_deadline(tmp_path, runtime):
    require_runtime(runtime)
    pause_timeout = 20.0
    audit_dir = tmp_path / "audit"
    gw = await start_gateway(
        tmp_path,
        default_runtime=runtime,
        idle_timeout=2,
        idle_action="pause",
        cull_interval=0.5,
        pause_timeout=pause_timeout,
        audit_dir=audit_dir,
        # Pauses that archive through the sandbox's tar. With memory snapshots (gVisor's default)
        # a pause runs no tar there at all (the disk is kept whole: docs/snapshots.md), but forks,
        # cell checkpoints and pauses on hosts or profiles without them still do.
        memory_snapshots="off",
    )
    try:
        _, stuck = await gw.request("POST", "/api/sessions", {})
        _, other = await gw.request("POST", "/api/sessions", {})
        _, canary = await gw.request("POST", "/api/sessions", {}, token=BOB)
        assert "armed" in (await execute(gw, stuck["id"], STOP_MY_TAR))["outputs"][0]["text"]
        await execute(gw, other["id"], "v = 7")
        # Both are idle two seconds later. The other one is paused while the stuck one's pause
        # still waits on its tar: one session's archive does not hold the culler.
        deadline = time.monotonic() + pause_timeout
        while (state := await state_of(gw, other["id"])) != "paused":
            assert time.monotonic() < deadline, f"the other session is still {state!r}"
            await execute(gw, canary["id"], "print(1)", token=BOB)  # keeps the canary busy: never idle
            await asyncio.sleep(0.2)
        # its pause is under way, stuck (a GET of it would wait for the pause to settle)
        assert stuck["id"] in gw.server.registry._idle_pauses
        assert await asyncio.to_thread(container_ids_of, stuck["id"])
        # At its deadline the stuck one is deleted, container and all, and the audit says why.
        deadline = time.monotonic() + pause_timeout + 60
        while (state := await state_of(gw, stuck["id"])) != "404":
            assert time.monotonic() < deadline, f"the stuck session is still {state!r}"
            await execute(gw, canary["id"], "print(1)", token=BOB)
            await asyncio.sleep(0.5)
        while await asyncio.to_thread(container_ids_of, stuck["id"]):  # removed right after it is unlisted
            assert time.monotonic() < deadline, "the stuck session's container is still there"
            await asyncio.sleep(0.2)
        assert (await execute(gw, canary["id"], "print(6 * 7)", token=BOB))["outputs"][0]["text"] == "42\n"
    finally:
        await stop_gateway(gw)
    deleted = [r for r in records(audit_dir) if r["event"] == "session_deleted" and r.get("session") == stuck["id"]]
    assert len(deleted) == 1 and "its pause failed" in deleted[0]["reason"], deleted
    assert chain.audit_files(audit_dir)


@pytest.mark.parametrize("runtime", [RUNTIME_PARAMS[0]])
async def test_sigterm_stops_the_gateway_whatever_its_tenants_processes_do(tmp_path, runtime):
    """``sandkernel serve`` on SIGTERM, while one tenant's pause waits on its stopped tar (it
    would wait 600 s), another session stops every new process in its sandbox (helpers, the
    removal's kill) and a third runs a loop that never ends: it stops cleanly (exit 0) within its
    shutdown grace and the time to remove what it holds, and leaves no container."""
    require_runtime(runtime)
    serve = Serve(tmp_path, runtime)
    await serve.start("--shutdown-grace", "2", "--on-exit", "delete")
    sessions = []
    try:
        for code in (STOP_MY_TAR, FREEZE_EVERY_NEW_PROCESS, None):
            status, session = await serve.call("POST", "/api/sessions", {})
            assert status == 201, session
            sessions.append(session["id"])
            if code is not None:
                status, reply = await serve.call("POST", f"/api/sessions/{session['id']}/execute", {"code": code})
                assert status == 200 and reply["status"] == "ok", reply
        stuck, _, busy = sessions
        pause = asyncio.create_task(serve.call("POST", f"/api/sessions/{stuck}/pause"))
        loop = asyncio.create_task(
            serve.call("POST", f"/api/sessions/{busy}/execute", {"code": "while True: pass", "timeout": 600})
        )
        container = (await asyncio.to_thread(container_ids_of, stuck))[0]
        await a_stopped_tar_in(container)
        assert not pause.done() and not loop.done()
        started = time.monotonic()
        assert await serve.term(timeout=STOP_MARGIN_SECONDS + 60) == 0, serve.output[-3000:]
        took = time.monotonic() - started
        assert took < STOP_MARGIN_SECONDS, f"stopping took {took:.1f} s:\n{serve.output[-3000:]}"
        for call in (pause, loop):
            with contextlib.suppress(Exception):
                await call  # answered or cut: either way it ended with the gateway
    finally:
        if serve.proc is not None and serve.proc.poll() is None:
            serve.kill9()
    for sid in sessions:
        assert await asyncio.to_thread(container_ids_of, sid) == [], sid
