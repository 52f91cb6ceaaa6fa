"""The gateway over real HTTP and WebSocket clients, with real sandboxed kernels behind it."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from sandkernel.gateway.budget import OutputBudget

from .conftest import container_ids_of
from .gateway_fixtures import ALICE, BOB, gateway_fixture

pytestmark = pytest.mark.docker


gateway = gateway_fixture(budget=OutputBudget(max_text_bytes=2000, max_images=1))


def execute_request(code: str) -> dict:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": "execute_request",
            "username": "t",
            "session": "s",
            "version": "5.3",
            "date": "2026-01-01T00:00:00Z",
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        "channel": "shell",
    }


async def ws_execute(ws, code: str, timeout: float = 60) -> tuple[list[dict], dict]:
    """Send an execute_request and collect iopub messages for it until idle, and its reply."""
    msg = execute_request(code)
    await ws.write_message(json.dumps(msg))
    iopub, reply = [], None

    async def collect():
        nonlocal reply
        while True:
            frame = await ws.read_message()
            assert frame is not None, "websocket closed"
            data = json.loads(frame)
            if data.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
                continue
            if data["channel"] == "shell":
                reply = data
            elif data["channel"] == "iopub":
                iopub.append(data)
            if reply and any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in iopub):
                return

    await asyncio.wait_for(collect(), timeout)
    return iopub, reply


async def connect(gateway, kernel_id: str, token: str = ALICE):
    url = gateway.url.replace("http", "ws") + f"/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    return await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}))


async def test_auth_is_required_and_errors_are_json(gateway):
    code, body = await gateway.request("GET", "/api/kernels", token=None)
    assert code == 401 and body["error"] == "unauthorized" and "Authorization: token" in body["message"]
    code, body = await gateway.request("GET", "/api/kernels", token="wrong-token-but-long-enough")
    assert code == 401
    code, body = await gateway.request("GET", "/api/kernels", token=None, headers={"Authorization": f"Bearer {ALICE}"})
    assert code == 200 and body == []
    code, body = await gateway.request("GET", "/api/no/such/thing")
    assert code == 404 and "openapi.json" in body["message"]
    code, body = await gateway.request("GET", "/api/openapi.json", token=None)
    assert code == 200 and "/api/sessions/{session_id}/execute" in body["paths"]


async def test_kernelspecs(gateway):
    code, body = await gateway.request("GET", "/api/kernelspecs")
    assert code == 200 and body["default"] == "sandkernel-python"
    assert set(body["kernelspecs"]) == {"sandkernel-python", "sandkernel-python-gvisor"}
    assert body["kernelspecs"]["sandkernel-python"]["spec"]["language"] == "python"


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
async def test_kernel_lifecycle_over_http_and_websocket(gateway):
    code, kernel = await gateway.request("POST", "/api/kernels", {"name": "sandkernel-python"})
    assert code == 201 and kernel["name"] == "sandkernel-python"
    kid = kernel["id"]
    code, listed = await gateway.request("GET", "/api/kernels")
    assert [k["id"] for k in listed] == [kid]
    ws = await connect(gateway, kid)
    iopub, reply = await ws_execute(ws, "x = 6 * 7\nprint('hello')\nx")
    assert reply["content"]["status"] == "ok"
    types = [m["msg_type"] for m in iopub]
    assert "stream" in types and "execute_result" in types
    result = next(m for m in iopub if m["msg_type"] == "execute_result")
    assert result["content"]["data"]["text/plain"] == "42"
    # A malformed frame gets an error on the socket; the kernel is untouched.
    await ws.write_message("{not json")
    complaint = json.loads(await ws.read_message())
    assert complaint["channel"] == "gateway" and complaint["error"] == "bad_message"
    await ws.write_message(json.dumps({"channel": "iopub", "header": {"msg_type": "x"}}))
    assert "cannot send on channel 'iopub'" in json.loads(await ws.read_message())["message"]
    _, reply = await ws_execute(ws, "x + 1")
    assert reply["content"]["status"] == "ok"
    ws.close()
    assert (await gateway.request("POST", f"/api/kernels/{kid}/interrupt"))[0] == 204
    code, restarted = await gateway.request("POST", f"/api/kernels/{kid}/restart")
    assert code == 200 and restarted["id"] == kid
    assert (await gateway.request("DELETE", f"/api/kernels/{kid}"))[0] == 204
    assert (await gateway.request("GET", f"/api/kernels/{kid}"))[0] == 404
    assert not kernel_containers(kid)


def kernel_containers(kernel_id: str):
    """The kernel's containers. Sparse (one listing, no inspect of each): another test process
    may remove one of its own between the listing and an inspect, which would raise NotFound."""
    from sandkernel.kernels.sandbox.docker_engine import default_engine

    return default_engine().client.containers.list(
        all=True, sparse=True, filters={"label": f"sandkernel.kernel={kernel_id}"}
    )


async def test_tenants_cannot_see_each_other(gateway):
    code, session = await gateway.request("POST", "/api/sessions", {"profile": "small"}, token=ALICE)
    assert code == 201
    sid, kid = session["id"], session["kernel"]["id"]
    missing_session = await gateway.request("GET", "/api/sessions/does-not-exist", token=BOB)
    for method, path in [
        ("GET", f"/api/sessions/{sid}"),
        ("DELETE", f"/api/sessions/{sid}"),
        ("GET", f"/api/kernels/{kid}"),
        ("POST", f"/api/kernels/{kid}/interrupt"),
    ]:
        code, body = await gateway.request(method, path, token=BOB)
        assert code == 404, (method, path)
        assert body["error"] == "not_found"
    assert missing_session[0] == 404
    code, body = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "1"}, token=BOB)
    assert code == 404
    assert (await gateway.request("GET", "/api/sessions", token=BOB))[1] == []
    with pytest.raises(Exception) as err:
        await connect(gateway, kid, token=BOB)
    assert "404" in str(err.value)
    code, body = await gateway.request("DELETE", f"/api/kernels/{kid}")
    assert code == 409 and f"DELETE /api/sessions/{sid}" in body["message"]
    # Alice's session still works and is hers.
    code, result = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "print('mine')"})
    assert code == 200 and result["text"] == "mine\n"
    assert (await gateway.request("DELETE", f"/api/sessions/{sid}"))[0] == 204
    assert container_ids_of(sid) == []


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
async def test_session_api_execute_budget_and_bad_input(gateway):
    code, body = await gateway.request("POST", "/api/sessions", {"limits": {"memory_mb": 1}})
    assert code == 400 and "memory_mb=1 is out of range" in body["message"]
    code, body = await gateway.request("POST", "/api/sessions", raw=b"{broken")
    assert code == 400 and body["error"] == "bad_json"
    code, session = await gateway.request("POST", "/api/sessions", {"metadata": {"agent": "test"}})
    assert code == 201 and session["metadata"] == {"agent": "test"} and session["path"].endswith(".ipynb")
    sid = session["id"]
    try:
        code, body = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": 42})
        assert code == 400 and "'code' must be a string" in body["message"]
        code, body = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "1", "timeout": -5})
        assert code == 400 and "timeout must be a number of seconds" in body["message"]
        code, result = await gateway.request(
            "POST", f"/api/sessions/{sid}/execute", {"code": "import sys\nprint('x' * 100000)\nprint('end')"}
        )
        assert code == 200 and result["status"] == "ok"
        assert result["truncation"]["truncated"] and result["truncation"]["text_bytes_cut"] > 90000
        text = result["outputs"][0]["text"]
        assert text.startswith("x" * 500) and text.rstrip().endswith("end") and "bytes of output cut" in text
        code, result = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "1/0"})
        assert code == 200 and result["status"] == "error" and result["error"]["name"] == "ZeroDivisionError"
        code, result = await gateway.request(
            "POST", f"/api/sessions/{sid}/execute", {"code": "while True: pass", "timeout": 1}
        )
        assert code == 200 and result["status"] == "timeout" and result["ended_by"] == "interrupt"
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


async def test_streaming_execute_sends_outputs_as_they_happen(gateway):
    code, session = await gateway.request("POST", "/api/sessions", {})
    sid = session["id"]
    lines: list[dict] = []
    chunks: list[bytes] = []

    def on_chunk(chunk: bytes) -> None:
        chunks.append(chunk)
        buffered = b"".join(chunks)
        *complete, rest = buffered.split(b"\n")
        chunks[:] = [rest]
        lines.extend(json.loads(line) for line in complete if line)

    try:
        code, _ = await gateway.request(
            "POST",
            f"/api/sessions/{sid}/execute?stream=1",
            {"code": "import sys, time\nfor i in range(3):\n    sys.stdout.write(f'{i}\\n'); sys.stdout.flush(); time.sleep(0.3)"},
            streaming_callback=on_chunk,
        )
        assert code == 200
        outputs = [line for line in lines if line["type"] == "output"]
        assert [o["output"]["text"] for o in outputs] == ["0\n", "1\n", "2\n"]
        assert lines[-1]["type"] == "result" and lines[-1]["result"]["status"] == "ok"
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


async def test_session_limit_per_tenant(gateway):
    created = []
    try:
        for _ in range(4):
            code, session = await gateway.request("POST", "/api/sessions", {"profile": "small"}, token=BOB)
            assert code == 201
            created.append(session["id"])
        code, body = await gateway.request("POST", "/api/sessions", {"profile": "small"}, token=BOB)
        assert code == 429 and "delete a session first" in body["message"]
    finally:
        for sid in created:
            await gateway.request("DELETE", f"/api/sessions/{sid}", token=BOB)


async def test_files_and_variables(gateway):
    _, session = await gateway.request("POST", "/api/sessions", {})
    sid = session["id"]
    try:
        code, written = await gateway.request(
            "PUT", f"/api/sessions/{sid}/files/data/sales.csv", raw=b"q,amount\nQ1,10\nQ2,32\n"
        )
        assert code == 201 and written == {"path": "data/sales.csv", "size": 21}
        code, result = await gateway.request(
            "POST",
            f"/api/sessions/{sid}/execute",
            {
                "code": "import pandas as pd\ndf = pd.read_csv('data/sales.csv')\ntotal = int(df.amount.sum())\n"
                "df.to_csv('out.csv', index=False)\nimport os\nos.symlink('/etc/passwd', 'leak')\nos.mkfifo('pipe')\nprint(total)"
            },
        )
        assert result["text"] == "42\n"
        code, listing = await gateway.request("GET", f"/api/sessions/{sid}/files")
        by_name = {e["name"]: e["type"] for e in listing}
        assert by_name["data"] == "directory" and by_name["out.csv"] == "file"
        assert by_name["leak"] == "symlink" and by_name["pipe"] == "other"
        code, listing = await gateway.request("GET", f"/api/sessions/{sid}/files?path=data")
        assert [e["name"] for e in listing] == ["sales.csv"]
        code, body = await gateway.request("GET", f"/api/sessions/{sid}/files/out.csv")
        assert code == 200 and body.startswith("q,amount")
        for path, status, error in [
            ("leak", 400, "not_regular"),
            ("pipe", 400, "not_regular"),
            ("..%2F..%2Fetc%2Fpasswd", 400, "bad_path"),
            ("missing.txt", 404, "not_found"),
        ]:
            code, body = await gateway.request("GET", f"/api/sessions/{sid}/files/{path}")
            assert (code, body["error"]) == (status, error), (path, body)
        code, body = await gateway.request("PUT", f"/api/sessions/{sid}/files/leak", raw=b"x")
        assert code == 400 and body["error"] == "not_regular"
        code, variables = await gateway.request("GET", f"/api/sessions/{sid}/variables")
        names = {v["name"]: v for v in variables}
        assert names["total"]["type"] == "int" and names["df"]["shape"] == [2, 2] and "pd" not in names
        # another tenant sees neither files nor variables
        assert (await gateway.request("GET", f"/api/sessions/{sid}/files/out.csv", token=BOB))[0] == 404
        assert (await gateway.request("GET", f"/api/sessions/{sid}/variables", token=BOB))[0] == 404
        # variables did not disturb the execution count
        _, after = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "1"})
        assert after["execution_count"] == result["execution_count"] + 1
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


async def test_oversized_body_gets_a_json_413(gateway):
    from sandkernel.gateway.http_api import MAX_BODY_BYTES

    code, body = await gateway.request("POST", "/api/sessions", raw=b"{" + b" " * (MAX_BODY_BYTES + 10) + b"}")
    assert code == 413 and body["error"] == "too_large" and "limit" in body["message"]
    code, health = await gateway.request("GET", "/api/health", token=None)
    assert code == 200 and health["status"] == "ok"


async def test_oversized_chunked_body_gets_a_json_413_not_a_cut_connection(gateway):
    """Without a Content-Length the limit is only found while reading: the gateway still answers
    413 (it used to log an uncaught exception and cut the connection) and goes on serving."""
    from sandkernel.gateway.http_api import MAX_BODY_BYTES

    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /api/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        + f"Authorization: token {ALICE}\r\n\r\n".encode()
    )
    chunk = b"x" * (1024 * 1024)
    # Just past the limit, then silence (no last chunk): the gateway must answer without the rest.
    for _ in range(MAX_BODY_BYTES // len(chunk) + 1):
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    writer.close()  # (the rest can be cut by a reset: the gateway closes on an unread body)
    assert head.startswith(b"HTTP/1.1 413") and b"application/json" in head, head
    code, health = await gateway.request("GET", "/api/health", token=None)
    assert code == 200 and health["status"] == "ok"


async def test_a_client_that_sends_its_whole_oversized_body_before_reading_still_gets_the_413(gateway):
    """Most clients send the whole body before they read. The 413 goes out at once; the body is
    then read and dropped, so the connection is not closed with unread bytes in it (which resets
    it and throws away the answer the client had not read yet: a CI run's MCP client saw a bare
    ReadError). Made certain here: the body is sent only after the answer has arrived."""
    from sandkernel.gateway.mcp.http import MAX_MCP_BODY_BYTES

    size = MAX_MCP_BODY_BYTES + 1024 * 1024
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: token {ALICE}\r\nContent-Length: {size}\r\n\r\n".encode()
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # answered before the body
    chunk = b"x" * (1024 * 1024)
    for _ in range(size // len(chunk)):
        writer.write(chunk)
        await writer.drain()
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    body = await asyncio.wait_for(reader.readexactly(length), 30)  # still there: no reset threw it away
    # The body was read to its end, so the connection can carry the next request.
    writer.write(f"GET /api/health HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n\r\n".encode())
    health = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"] == "too_large" and "limit" in json.loads(body)["message"], body
    assert health.startswith(b"HTTP/1.1 200"), health


async def test_gateway_tokens_never_reach_the_kernel(gateway):
    _, session = await gateway.request("POST", "/api/sessions", {})
    try:
        _, result = await gateway.request(
            "POST",
            f"/api/sessions/{session['id']}/execute",
            {"code": "import os, json\nprint(json.dumps(dict(os.environ)))"},
        )
        environment = result["text"]
        assert ALICE not in environment and BOB not in environment and "SANDKERNEL_TOKEN" not in environment
    finally:
        await gateway.request("DELETE", f"/api/sessions/{session['id']}")


async def test_streaming_client_that_disconnects_interrupts_its_code(gateway):
    import socket as socketlib

    _, session = await gateway.request("POST", "/api/sessions", {})
    sid = session["id"]
    try:
        body = json.dumps({"code": "import time\nprint('working', flush=True)\ntime.sleep(600)"}).encode()
        raw = socketlib.create_connection(("127.0.0.1", gateway.port))
        raw.sendall(
            f"POST /api/sessions/{sid}/execute?stream=1 HTTP/1.1\r\nHost: x\r\nAuthorization: token {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"working" not in received:  # the code is running: its first output has streamed
            chunk = await asyncio.to_thread(raw.recv, 4096)
            assert chunk, "stream closed early"
            received += chunk
        raw.close()
        for _ in range(200):  # bounded wait for the outcome
            _, model = await gateway.request("GET", f"/api/sessions/{sid}")
            if model["kernel"]["execution_state"] == "idle":
                break
            await asyncio.sleep(0.05)
        assert model["kernel"]["execution_state"] == "idle"
        _, result = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "print('free')"})
        assert result["text"] == "free\n"
        _, nb = await gateway.request("GET", f"/api/sessions/{sid}/notebook")
        statuses = [c["metadata"]["sandkernel"]["status"] for c in nb["cells"] if c["cell_type"] == "code"]
        assert statuses == ["interrupted", "ok"]
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


async def test_requests_on_a_session_shut_down_under_them_get_a_404_not_a_500(gateway):
    """A session shut down while still registered (what a request sees when a delete or the culler
    wins a race with it) answers every API with a JSON 404 saying so; before errors were mapped in
    one place, the files API answered 500 (and any other failure of it 503)."""
    _, session = await gateway.request("POST", "/api/sessions", {})
    sid = session["id"]
    try:
        await gateway.server.registry.get("alice", sid).session.shutdown()
        for method, path, body in [
            ("POST", f"/api/sessions/{sid}/execute", {"code": "1"}),
            ("POST", f"/api/sessions/{sid}/execute?stream=1", {"code": "1"}),
            ("POST", f"/api/sessions/{sid}/restart", None),
            ("POST", f"/api/sessions/{sid}/interrupt", None),
            ("GET", f"/api/sessions/{sid}/variables", None),
            ("GET", f"/api/sessions/{sid}/files", None),
            ("GET", f"/api/sessions/{sid}/files/data.csv", None),
        ]:
            code, reply = await gateway.request(method, path, body)
            assert (code, reply["error"]) == (404, "session_closed"), (method, path, code, reply)
            assert sid in reply["message"], reply  # names the session, whose wording the session layer owns
        code, reply = await gateway.request("PUT", f"/api/sessions/{sid}/files/data.csv", raw=b"a,b\n")
        assert (code, reply["error"]) == (404, "session_closed"), reply
    finally:
        assert (await gateway.request("DELETE", f"/api/sessions/{sid}"))[0] == 204
    assert (await gateway.request("GET", f"/api/sessions/{sid}"))[0] == 404
    assert container_ids_of(sid) == []


@pytest.mark.parametrize("route", ["sessions", "kernels"])
async def test_restart_leaves_the_session_idle_on_both_routes(gateway, route):
    """Restart rescues a running execution: the reply (and the session) say idle at once, through
    the kernel API and the session API alike (only the kernel API did before: one implementation now)."""
    _, session = await gateway.request("POST", "/api/sessions", {})
    sid, kid = session["id"], session["kernel"]["id"]
    try:
        running = asyncio.create_task(
            gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "import time\ntime.sleep(600)"})
        )
        for _ in range(200):  # bounded wait until the execution is under way
            _, model = await gateway.request("GET", f"/api/sessions/{sid}")
            if model["kernel"]["execution_state"] == "busy":
                break
            await asyncio.sleep(0.05)
        assert model["kernel"]["execution_state"] == "busy"
        target = f"/api/sessions/{sid}/restart" if route == "sessions" else f"/api/kernels/{kid}/restart"
        code, reply = await gateway.request("POST", target)
        assert code == 200
        kernel = reply["kernel"] if route == "sessions" else reply
        assert kernel["execution_state"] == "idle", reply
        code, result = await asyncio.wait_for(running, 120)
        assert code == 200 and result["status"] != "ok"  # the sleep did not finish
        code, after = await gateway.request("POST", f"/api/sessions/{sid}/execute", {"code": "print('fresh')"})
        assert after["text"] == "fresh\n"
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")


async def stream_execute(gateway, sid: str, code: str) -> tuple[int, list[dict]]:
    """POST a streamed execute with a real streaming HTTP client; the NDJSON lines as they came."""
    lines: list[dict] = []
    pending = bytearray()

    def on_chunk(chunk: bytes) -> None:
        pending.extend(chunk)
        while b"\n" in pending:
            line, _, rest = bytes(pending).partition(b"\n")
            pending[:] = rest
            lines.append(json.loads(line))

    status, _ = await gateway.request(
        "POST", f"/api/sessions/{sid}/execute?stream=1", {"code": code}, streaming_callback=on_chunk
    )
    return status, lines


async def test_streaming_sends_each_output_once_within_the_budget_and_never_drops_the_error(gateway):
    """The gateway's reply budget is 2000 bytes of text. A cell that prints past it, keeps printing,
    shows a figure and then fails: the stream carries each output once (the final line repeats
    none), cut by the same budget as a whole reply, and the error arrives whatever the budget.
    Before: outputs were sent twice (each line and again in the result) and, once the stream's own
    count passed the budget, everything after it, the error included, was silently dropped."""
    _, session = await gateway.request("POST", "/api/sessions", {})
    sid = session["id"]
    code = (
        "import sys\nprint('x' * 3000, flush=True)\n"
        "for i in range(20):\n    print(f'line {i}', flush=True)\n"
        "from IPython.display import display, HTML\ndisplay(HTML('<b>late</b>'))\n"
        "raise ValueError('the end')"
    )
    try:
        status, lines = await stream_execute(gateway, sid, code)
        assert status == 200
        outputs = [line["output"] for line in lines if line["type"] == "output"]
        [result] = [line["result"] for line in lines if line["type"] == "result"]
        assert lines[-1]["type"] == "result"
        assert result["status"] == "error" and result["error"]["name"] == "ValueError"
        # the error was streamed, whole, and is not repeated in the final line
        errors = [o for o in outputs if o["output_type"] == "error"]
        assert len(errors) == 1 and errors[0]["evalue"] == "the end" and errors[0]["traceback"]
        assert result["outputs"] == [] and result["streamed"] == len(outputs)
        assert "text" not in result  # the final line is a summary, not a second copy
        # the budget: 2000 bytes of text in all, the big print cut with a marker, the rest counted
        streamed_text = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
        assert streamed_text.startswith("x" * 900) and "bytes of output cut" in streamed_text
        assert len(streamed_text.replace("x", "")) < 500 and streamed_text.count("x") <= 2000
        truncation = result["truncation"]
        assert truncation["truncated"] and truncation["max_text_bytes"] == 2000
        assert truncation["outputs_withheld"] >= 20  # the lines and the HTML past the budget, counted
        assert truncation["text_bytes_cut"] >= 1000 + sum(len(f"line {i}\n") for i in range(20))
        # the transcript still has everything
        _, nb = await gateway.request("GET", f"/api/sessions/{sid}/notebook")
        cell = [c for c in nb["cells"] if c["cell_type"] == "code"][-1]
        assert "line 19" in "".join(o.get("text", "") for o in cell["outputs"])
    finally:
        await gateway.request("DELETE", f"/api/sessions/{sid}")
