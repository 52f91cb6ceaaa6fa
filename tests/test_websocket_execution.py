"""The Jupyter websocket runs code on the session's one execution path.

A JupyterLab execute_request is queued behind other doors' executions, stopped by the operator's
timeout ladder, classified when the kernel dies or runs out of memory, counted in the metrics and
recorded in the transcript exactly as a session-API execute; the client still gets every
message as the kernel sent it, and the kernel's own queue semantics (stop_on_error aborts) hold.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from .conftest import DOOR_RUNTIME_PARAMS, RUNTIME_PARAMS
from .gateway_fixtures import OPERATOR, gateway_fixture
from .test_gateway import connect, execute_request, kernel_containers, ws_execute

pytestmark = pytest.mark.docker

# A grace long enough that a loaded gVisor host still answers the interrupt inside it.
LIMITS = {"execute_timeout": 3, "interrupt_grace": 5, "memory_mb": 256}


gw = gateway_fixture(runtimes=DOOR_RUNTIME_PARAMS)  # the door's code; the OOM's verdict under both


@pytest.fixture
async def gateway_session(gw):
    """A session made through the gateway's API on ``gw``: its JSON model (``id``, ``kernel``, ...)."""
    status, body = await gw.request("POST", "/api/sessions", {"limits": {"runtime": gw.runtime, **LIMITS}})
    assert status == 201, body
    yield body
    await gw.request("DELETE", f"/api/sessions/{body['id']}")


async def code_cells(gw, session) -> list[dict]:
    status, notebook = await gw.request("GET", f"/api/sessions/{session['id']}/notebook")
    assert status == 200
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


async def wait_for_cell(gw, session, source: str, attempts: int = 600) -> dict:
    """The transcript cell of ``source`` once recorded (the execution may still be running)."""
    for _ in range(attempts):
        for cell in await code_cells(gw, session):
            if cell["source"] == source:
                return cell
        await asyncio.sleep(0.1)
    raise AssertionError(f"no cell for {source!r} in the transcript")


async def wait_for_cells(gw, session, count: int, attempts: int = 600) -> None:
    """Until the transcript holds ``count`` code cells."""
    for _ in range(attempts):
        if len(await code_cells(gw, session)) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the transcript never held {count} code cells")


def _without_counts(outputs: list[dict]) -> list[dict]:
    return [{k: v for k, v in output.items() if k != "execution_count"} for output in outputs]


def status_of(cell: dict) -> str:
    return cell["metadata"]["sandkernel"]["status"]


async def test_websocket_execute_is_recorded_like_the_session_api(gw, gateway_session):
    code = "print('hello'); 6 * 7"
    status, api = await gw.request("POST", f"/api/sessions/{gateway_session['id']}/execute", {"code": code})
    assert status == 200 and api["status"] == "ok"
    ws = await connect(gw, gateway_session["kernel"]["id"])
    try:
        iopub, reply = await ws_execute(ws, code)
    finally:
        ws.close()
    assert reply["content"]["status"] == "ok"
    assert [m["content"].get("text") for m in iopub if m["msg_type"] == "stream"] == ["hello\n"]
    await wait_for_cells(gw, gateway_session, 2)  # the client may see the reply before the cell is written
    api_cell, ws_cell = (await code_cells(gw, gateway_session))[-2:]
    assert api_cell["source"] == ws_cell["source"] == code
    assert _without_counts(api_cell["outputs"]) == _without_counts(ws_cell["outputs"])
    assert len(ws_cell["outputs"]) == 2
    assert ws_cell["execution_count"] == api_cell["execution_count"] + 1 == reply["content"]["execution_count"]
    assert (api_cell["metadata"]["sandkernel"]["source"], ws_cell["metadata"]["sandkernel"]["source"]) == (
        "session_api",
        "websocket",
    )
    assert status_of(api_cell) == status_of(ws_cell) == "ok"


async def test_websocket_executes_queue_behind_other_doors(gw, gateway_session):
    api_code = "import time; time.sleep(2); order = ['api']"
    api = asyncio.create_task(gw.request("POST", f"/api/sessions/{gateway_session['id']}/execute", {"code": api_code}))
    await wait_for_busy(gw, gateway_session)
    ws = await connect(gw, gateway_session["kernel"]["id"])
    try:
        _, reply = await ws_execute(ws, "order.append('ws'); print(order)")
    finally:
        ws.close()
    assert (await api)[1]["status"] == "ok" and reply["content"]["status"] == "ok"
    await wait_for_cells(gw, gateway_session, 2)
    api_cell, ws_cell = (await code_cells(gw, gateway_session))[-2:]
    assert api_cell["source"] == api_code
    api_info, ws_info = api_cell["metadata"]["sandkernel"], ws_cell["metadata"]["sandkernel"]
    # The websocket's execution started once the API's had ended, not when its request arrived.
    api_end = _seconds(api_info["started_at"]) + api_info["duration"]
    assert _seconds(ws_info["started_at"]) >= api_end - 0.01, (api_info, ws_info)


async def wait_for_busy(gw, session) -> None:
    for _ in range(300):
        _, kernel = await gw.request("GET", f"/api/kernels/{session['kernel']['id']}")
        if kernel["execution_state"] == "busy":
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the session never went busy")


def _seconds(iso: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(iso).timestamp()


async def test_websocket_execute_is_stopped_by_the_timeout_ladder(gw, gateway_session):
    ws = await connect(gw, gateway_session["kernel"]["id"])
    try:
        iopub, reply = await ws_execute(ws, "while True: pass", timeout=60)
        assert reply["content"]["status"] == "error"
        assert any(m["msg_type"] == "error" and m["content"]["ename"] == "KeyboardInterrupt" for m in iopub)
        cell = await wait_for_cell(gw, gateway_session, "while True: pass")
        assert status_of(cell) == "timeout" and cell["metadata"]["sandkernel"]["ended_by"] == "interrupt"
        # Code that ignores the interrupt: the ladder restarts the kernel.
        stubborn = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
        await ws.write_message(json.dumps(execute_request(stubborn)))
        cell = await wait_for_cell(gw, gateway_session, stubborn)
        assert status_of(cell) == "timeout"
        assert cell["metadata"]["sandkernel"]["ended_by"] in ("restart", "kill")
        assert "exceeded its 3s timeout" in cell["metadata"]["sandkernel"]["state_lost"]
    finally:
        ws.close()
    ws = await connect(gw, gateway_session["kernel"]["id"])  # a restart may have replaced the container
    try:
        _, reply = await ws_execute(ws, "print('back')", timeout=120)
    finally:
        ws.close()
    assert reply["content"]["status"] == "ok"


@pytest.mark.parametrize("gw", RUNTIME_PARAMS, indirect=True)  # each runtime's OOM is seen its own way
async def test_websocket_oom_is_classified_counted_and_survived(gw, gateway_session):
    ws = await connect(gw, gateway_session["kernel"]["id"])
    bomb = "b = bytearray(2 * 1024**3)"
    try:
        await ws.write_message(json.dumps(execute_request(bomb)))
        cell = await wait_for_cell(gw, gateway_session, bomb)
    finally:
        ws.close()
    assert status_of(cell) == "oom"
    assert "ran out of memory (limit 256 MiB)" in cell["metadata"]["sandkernel"]["state_lost"]
    ws = await connect(gw, gateway_session["kernel"]["id"])
    try:
        _, reply = await ws_execute(ws, "print('alive')", timeout=120)
    finally:
        ws.close()
    assert reply["content"]["status"] == "ok"
    status, metrics = await gw.request("GET", "/metrics", token=OPERATOR)
    assert status == 200
    assert _metric(metrics, 'sandkernel_kernel_deaths_total{cause="oom"}') >= 1
    assert _metric(metrics, 'sandkernel_executes_total{status="oom"}') >= 1


# Code that leaves a startup file in the container's IPython dir (on its /tmp) and dies: the
# restart after the death hangs in that file, so the ladder's last rung replaces the container.
HANG_EVERY_RESTART = """import os
startup = os.path.join(os.environ["IPYTHONDIR"], "profile_default", "startup")
os.makedirs(startup, exist_ok=True)
open(os.path.join(startup, "00-hang.py"), "w").write("import time; time.sleep(3600)")
os._exit(1)"""


async def test_a_replaced_container_keeps_the_kernel_id_its_clients_hold(gw):
    """The ladder's last rung (a restart cannot come up, so the container is replaced) keeps the
    kernel id, as a Jupyter restart does: JupyterLab, nbclient or a websocket user holding it
    reconnects to the new kernel, instead of a 404 for a kernel that still serves them."""
    limits = {"runtime": gw.runtime, **LIMITS, "start_timeout": 15}
    status, session = await gw.request("POST", "/api/sessions", {"limits": limits})
    assert status == 201, session
    try:
        kernel_id = session["kernel"]["id"]
        [old] = kernel_containers(kernel_id)
        ws = await connect(gw, kernel_id)
        try:
            await ws.write_message(json.dumps(execute_request(HANG_EVERY_RESTART)))
            cell = await wait_for_cell(gw, session, HANG_EVERY_RESTART)
        finally:
            ws.close()
        assert status_of(cell) == "kernel_died", cell
        status, model = await gw.request("GET", f"/api/sessions/{session['id']}")
        assert status == 200 and model["kernel"]["id"] == kernel_id, model
        ws = await connect(gw, kernel_id)
        try:
            _, reply = await ws_execute(ws, "print('alive')", timeout=120)
        finally:
            ws.close()
        assert reply["content"]["status"] == "ok", reply
        after = await wait_for_cell(gw, session, "print('alive')")
        assert "restart did not come up, so the container was replaced" in after["metadata"]["sandkernel"]["state_lost"]
        [new] = kernel_containers(kernel_id)
        assert new.id != old.id
    finally:
        await gw.request("DELETE", f"/api/sessions/{session['id']}")


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def test_a_failed_execute_aborts_the_queue_behind_it(gw, gateway_session):
    ws = await connect(gw, gateway_session["kernel"]["id"])
    try:
        requests = [
            execute_request("import time; time.sleep(0.5); raise ValueError('boom')"),
            execute_request("ran_b = True"),
            execute_request("ran_c = True"),
        ]
        for msg in requests:
            await ws.write_message(json.dumps(msg))
        replies: dict[str, str] = {}
        while len(replies) < 3:
            data = json.loads(await asyncio.wait_for(ws.read_message(), 60))
            if data.get("channel") == "shell" and data["msg_type"] == "execute_reply":
                replies[data["parent_header"]["msg_id"]] = data["content"]["status"]
        assert [replies[m["header"]["msg_id"]] for m in requests] == ["error", "aborted", "aborted"]
        _, reply = await ws_execute(ws, "print('ran_b' in globals(), 'ran_c' in globals())")
        assert reply["content"]["status"] == "ok"
    finally:
        ws.close()
    await wait_for_cell(gw, gateway_session, "print('ran_b' in globals(), 'ran_c' in globals())")
    sources = [cell["source"] for cell in await code_cells(gw, gateway_session)]
    assert "ran_b = True" not in sources and "ran_c = True" not in sources
    assert sources[-1] == "print('ran_b' in globals(), 'ran_c' in globals())"
    last = (await code_cells(gw, gateway_session))[-1]
    assert last["outputs"][0]["text"] == "False False\n"


async def stream_seen(ws, msg_id: str, text: str) -> None:
    """Until the execution ``msg_id`` has printed ``text``."""
    while True:
        frame = await ws.read_message()
        assert frame is not None, "websocket closed"
        data = json.loads(frame)
        mine = data.get("parent_header", {}).get("msg_id") == msg_id
        if mine and data["msg_type"] == "stream" and text in data["content"]["text"]:
            return


@pytest.fixture
async def untimed_session(gw):
    """A session whose timeout is far away, so only the client's interrupt can end its cell."""
    limits = {**LIMITS, "runtime": gw.runtime, "execute_timeout": 600}
    status, body = await gw.request("POST", "/api/sessions", {"limits": limits})
    assert status == 201, body
    yield body
    await gw.request("DELETE", f"/api/sessions/{body['id']}")


async def test_websocket_interrupt_ends_the_execution_as_interrupted(gw, untimed_session):
    session = untimed_session
    ws = await connect(gw, session["kernel"]["id"])
    code = "import time; print('sleeping', flush=True); time.sleep(100)"
    try:
        msg = execute_request(code)
        await ws.write_message(json.dumps(msg))
        # Interrupt once the code runs: a SIGINT that reaches the kernel before it has started the
        # cell (the session is already busy then) interrupts nothing, and the cell would sleep on.
        await asyncio.wait_for(stream_seen(ws, msg["header"]["msg_id"], "sleeping"), 60)
        interrupt = execute_request("")
        interrupt["channel"] = "control"
        interrupt["header"]["msg_type"] = "interrupt_request"
        interrupt["content"] = {}
        await ws.write_message(json.dumps(interrupt))
        cell = await wait_for_cell(gw, session, code)
    finally:
        ws.close()
    assert status_of(cell) == "interrupted"


async def test_an_execution_outlives_its_closed_websocket(gw, gateway_session):
    ws = await connect(gw, gateway_session["kernel"]["id"])
    code = "import time; time.sleep(1); print('finished')"
    await ws.write_message(json.dumps(execute_request(code)))
    await wait_for_busy(gw, gateway_session)
    ws.close()
    cell = await wait_for_cell(gw, gateway_session, code)
    assert status_of(cell) == "ok" and cell["outputs"][0]["text"] == "finished\n"
    status, api = await gw.request("POST", f"/api/sessions/{gateway_session['id']}/execute", {"code": "print(2)"})
    assert status == 200 and api["status"] == "ok"
