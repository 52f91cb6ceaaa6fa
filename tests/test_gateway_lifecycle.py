"""Gateway limits and lifecycle: health, metrics, hostile cells beside a healthy session,
idle culling, and a graceful shutdown that returns in-flight executes before removing containers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from .conftest import container_ids_of
from .gateway_fixtures import OPERATOR, PeakRss, gateway_fixture, start_gateway, stop_gateway

pytestmark = pytest.mark.docker


gateway = gateway_fixture()


async def test_health_needs_no_token_and_metrics_the_operators(gateway):
    code, health = await gateway.request("GET", "/api/health", token=None)
    assert code == 200 and health["status"] == "ok"
    code, _ = await gateway.request("POST", "/api/sessions", {"limits": {"pids": 1}})
    assert code == 400
    code, metrics = await gateway.request("GET", "/metrics", token=OPERATOR)
    assert code == 200 and "sandkernel_sessions" in metrics and "sandkernel_execute_duration_seconds" in metrics


async def test_hostile_cells_do_not_disturb_another_session(gateway):
    _, victim = await gateway.request("POST", "/api/sessions", {})
    _, hostile = await gateway.request("POST", "/api/sessions", {})
    # 1 GiB of output, flushed in 1 MiB messages as fast as the kernel can write them.
    flood = "import sys\nchunk = 'x' * 2**20 + '\\n'\nfor _ in range(1024):\n    sys.stdout.write(chunk); sys.stdout.flush()"
    try:

        async def attack():
            code, result = await gateway.request(
                "POST", f"/api/sessions/{hostile['id']}/execute", {"code": flood, "timeout": 120}
            )
            assert code == 200 and result["status"] == "ok" and result["truncation"]["truncated"]
            code, result = await gateway.request(
                "POST", f"/api/sessions/{hostile['id']}/execute", {"code": "while True: pass", "timeout": 3}
            )
            assert code == 200 and result["status"] == "timeout"
            return True

        async def keep_working():
            done = 0
            while not attack_task.done():
                code, result = await gateway.request("POST", f"/api/sessions/{victim['id']}/execute", {"code": "1 + 1"})
                assert code == 200 and result["status"] == "ok" and result["outputs"][0]["data"]["text/plain"] == "2"
                done += 1
            return done

        async with PeakRss() as rss:
            attack_task = asyncio.create_task(attack())
            executed = await keep_working()
            assert await attack_task
        assert executed >= 3
        # The gateway (this process) did not hold the gigabyte: growth stays near the bounded queues.
        assert rss.growth < 400, f"gateway memory grew {rss.growth:.0f} MiB during a 1 GiB flood"
        code, health = await gateway.request("GET", "/api/health")  # counts need a token
        assert code == 200 and health["sessions"] >= 2
    finally:
        for s in (victim, hostile):
            await gateway.request("DELETE", f"/api/sessions/{s['id']}")


async def test_idle_sessions_are_culled(tmp_path):
    gw = await start_gateway(tmp_path, idle_timeout=1.0, cull_interval=0.2, idle_action="delete")
    try:
        _, session = await gw.request("POST", "/api/sessions", {})
        for _ in range(300):  # bounded wait for the outcome, not a fixed sleep
            code, _ = await gw.request("GET", f"/api/sessions/{session['id']}")
            if code == 404 and not container_ids_of(session["id"]):
                break
            await asyncio.sleep(0.1)
        assert code == 404
        assert container_ids_of(session["id"]) == []
    finally:
        await stop_gateway(gw)


async def test_graceful_shutdown_returns_in_flight_executes(tmp_path):
    gw = await start_gateway(tmp_path, shutdown_grace=20)
    _, session = await gw.request("POST", "/api/sessions", {})
    running = asyncio.create_task(
        gw.request("POST", f"/api/sessions/{session['id']}/execute", {"code": "import time\ntime.sleep(600)"})
    )
    deadline = time.monotonic() + 60  # a loaded machine may take a while to start the cell
    while (await gw.request("GET", f"/api/sessions/{session['id']}"))[1]["kernel"]["execution_state"] != "busy":
        assert time.monotonic() < deadline, "the cell never started"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    await stop_gateway(gw)
    code, result = await running
    assert code == 200 and result["status"] == "interrupted"
    assert container_ids_of(session["id"]) == []


async def test_a_port_in_use_is_a_one_line_error_that_says_what_to_change(gateway, tmp_path):
    """``sandkernel serve`` on a port another process holds (here the module's gateway): exit 2
    with the address and what to change, no traceback, and the running gateway unharmed."""
    command = [sys.executable, "-m", "sandkernel.cli", "serve", "--ip", "127.0.0.1", "--port", str(gateway.port)]
    command += ["--token", "t" * 32, "--state-dir", str(tmp_path / "state"), "--pool-size", "0", "--on-exit", "delete"]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{gateway.port}" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr
    code, health = await gateway.request("GET", "/api/health", token=None)
    assert code == 200 and health["status"] == "ok"
