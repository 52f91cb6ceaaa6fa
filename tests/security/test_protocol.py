"""Transport and protocol: kernel output is untrusted (forged, mis-signed, oversized messages),
websocket clients may be malformed, slow or many, and the socket directory is the kernel's to
tamper with. The host never follows the kernel's paths and never misattributes its messages."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClosedError, websocket_connect

from sandkernel.kernels.execution.variables import MAX_LISTING_CHARS

from ..gateway_fixtures import ALICE, rss_mib
from ..test_gateway import execute_request, ws_execute
from ..test_transport import UnixListener

pytestmark = [pytest.mark.security, pytest.mark.docker]

FORGE = """from ipykernel.kernelbase import Kernel
import json, hmac, hashlib
kernel = Kernel.instance()
parent = kernel.get_parent()
key = kernel.session.key
def frames(msg_type, content, parent_header, signature=None):
    header = kernel.session.msg_header(msg_type)
    parts = [kernel.session.pack(p) for p in (header, parent_header, {}, content)]
    if signature is None:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for p in parts:
            mac.update(p)
        signature = mac.hexdigest().encode()
    return [b"stream.stdout", b"<IDS|MSG>", signature] + parts
"""


def ws_url(arena, kernel_id: str | None = None) -> str:
    kid = kernel_id or arena.attacker["kernel"]["id"]
    return f"ws://127.0.0.1:{arena.gateway.port}/api/kernels/{kid}/channels?session_id={uuid.uuid4().hex}"


async def ws(arena) -> object:
    return await websocket_connect(HTTPRequest(ws_url(arena), headers={"Authorization": f"token {ALICE}"}))


async def test_mis_signed_kernel_messages_are_dropped(arena):
    code = (
        FORGE
        + """
kernel.iopub_socket.send_multipart(frames("stream", {"name": "stdout", "text": "FORGED\\n"}, parent["header"], b"0" * 64))
import time; time.sleep(0.3)
print("real")"""
    )
    reply = await arena.attack(code)
    assert reply["status"] == "ok" and reply["text"] == "real\n", reply
    conn = await ws(arena)
    try:
        iopub, shell = await ws_execute(conn, code)
        texts = [m["content"].get("text") for m in iopub if m["msg_type"] == "stream"]
        assert shell["content"]["status"] == "ok" and texts == ["real\n"], texts
    finally:
        conn.close()


async def test_forged_messages_for_other_requests_are_not_misattributed(arena):
    """Validly signed (the kernel holds its key) but addressed to a request that is not running:
    neither this execute nor the next one shows it."""
    reply = await arena.attack(
        FORGE
        + """
fake_parent = dict(parent["header"], msg_id="not-a-request-" + parent["header"]["msg_id"])
kernel.iopub_socket.send_multipart(frames("stream", {"name": "stdout", "text": "MISDIRECTED\\n"}, fake_parent))
kernel.iopub_socket.send_multipart(frames("status", {"execution_state": "idle"}, fake_parent))
print("mine")"""
    )
    assert reply["status"] == "ok" and reply["text"] == "mine\n", reply
    after = await arena.attack("print('next')")
    assert after["text"] == "next\n", after


async def test_oversized_kernel_message_is_dropped_not_buffered(arena):
    """An 80 MiB message is over the transport's 64 MiB cap: ZMQ refuses it (the gateway's memory
    never holds it) and cuts the subscriber. The session reconnects its output channel and says
    what was lost; a websocket client is closed (1011) so it reconnects; later outputs flow."""
    big = "from IPython.display import display\ndisplay({'text/plain': 'x' * (80 * 2**20)}, raw=True)"
    conn = await ws(arena)
    before = rss_mib()
    reply = await arena.attack(big, timeout=60)
    assert reply["status"] == "ok" and "over the 64 MiB transport limit" in reply["text"], reply
    assert rss_mib() - before < 300
    after = await arena.attack("print('still here')")
    assert after["status"] == "ok" and after["text"] == "still here\n"
    while await asyncio.wait_for(conn.read_message(), 60) is not None:
        pass  # kernel traffic, until the gateway closes: it saw the subscription cut and probed it
    assert conn.close_code == 1011 and "reconnect" in conn.close_reason
    fresh = await ws(arena)
    try:
        _, shell = await ws_execute(fresh, "print('again')")
        assert shell["content"]["status"] == "ok"
    finally:
        fresh.close()


async def read_complaint(conn) -> dict:
    """The next gateway message on the socket (kernel traffic may come first)."""
    while True:
        frame = await asyncio.wait_for(conn.read_message(), 30)
        assert frame is not None, "websocket closed"
        message = json.loads(frame)
        if message.get("channel") == "gateway":
            return message


async def test_malformed_and_oversized_websocket_frames(arena):
    assert (await arena.attack("print('idle')"))["text"] == "idle\n"  # the kernel is done with earlier attacks
    conn = await ws(arena)
    try:
        nested = "[" * 100_000 + "]" * 100_000  # valid JSON too deep for Python's parser
        for frame in ("{not json", json.dumps({"channel": "shell"}), json.dumps([1, 2]), "x" * 1000, nested):
            await conn.write_message(frame)
            assert (await read_complaint(conn))["error"] == "bad_message"
        await conn.write_message(b"\x00\x01garbage", binary=True)
        assert (await read_complaint(conn))["error"] == "bad_message"
        _, shell = await ws_execute(conn, "1 + 1", timeout=120)
        assert shell["content"]["status"] == "ok"
        try:  # over the 16 MiB websocket cap: the gateway closes this connection, maybe mid-write
            await conn.write_message("x" * (17 * 1024 * 1024))
            while await asyncio.wait_for(conn.read_message(), 30) is not None:
                pass  # kernel traffic still in flight, then the close
        except WebSocketClosedError:
            pass
        assert conn.close_code == 1009 or conn.protocol is None
    finally:
        conn.close()


async def test_a_client_that_reads_nothing_cannot_grow_the_gateway(arena):
    conn = await ws(arena)
    before = rss_mib()
    try:
        flood = "import sys\nchunk = 'y' * 2**20 + '\\n'\nfor _ in range(300):\n    sys.stdout.write(chunk); sys.stdout.flush()"
        await conn.write_message(json.dumps(execute_request(flood)))
        peak = before
        for _ in range(40):  # 8 s of flood while nobody reads
            await asyncio.sleep(0.2)
            peak = max(peak, rss_mib())
        latency = await arena.canary_execute()
        assert peak - before < 300, f"gateway grew {peak - before:.0f} MiB for a client that reads nothing"
        assert latency < 30
    finally:
        conn.close()
    await arena.attack("print('drained')", timeout=120)


async def test_connection_flood_is_bounded(arena):
    opened, refused = [], 0
    try:
        for _ in range(40):
            try:
                opened.append(await ws(arena))
            except HTTPClientError as err:
                assert err.code == 429
                refused += 1
        assert len(opened) == 16 and refused == 24
        assert (await arena.gateway.request("GET", "/api/health", token=None))[0] == 200
    finally:
        for conn in opened:
            conn.close()
    await asyncio.sleep(0.5)
    again = await ws(arena)  # closed connections give their slots back
    again.close()


async def test_socket_directory_tampering_is_refused_and_never_followed(arena):
    listener = UnixListener()
    try:
        reply = await arena.attack(
            f"""import os
for name, attempt in [
    ("unlink", lambda: os.unlink('/run/sandkernel/k-1')),
    ("rename", lambda: os.rename('/run/sandkernel/k-2', '/run/sandkernel/old')),
    ("symlink", lambda: os.symlink({listener.path!r}, '/run/sandkernel/k-9')),
    ("chmod", lambda: os.chmod('/run/sandkernel', 0o777)),
    ("create", lambda: open('/run/sandkernel/new', 'w')),
]:
    try:
        attempt(); print(name, 'SUCCEEDED')
    except OSError as e:
        print(name, 'refused')"""
        )
        assert reply["text"].count("refused") == 5, reply["text"]
        conn = await ws(arena)  # fresh host connections to the kernel's sockets
        try:
            _, shell = await ws_execute(conn, "40 + 2")
            assert shell["content"]["status"] == "ok"
        finally:
            conn.close()
    finally:
        assert listener.close() == 0


FORGED_LISTING = """import sys
real_listing = sys.modules['sandkernel_variables']
class NotALiteral:
    def __repr__(self):
        return '[1, 2'
class ForgedListing:
    def listing(self, ip):
        return NotALiteral()
sys.modules['sandkernel_variables'] = ForgedListing()
listed_after = 1
"""
# A listing that parses, but is 40 MiB: it took 0.7 s of the gateway's event loop to parse.
HUGE_LISTING = """import json
class HugeListing:
    def listing(self, ip):
        return json.dumps([{'name': 'x' * 1000, 'type': 'int', 'size': 1, 'shape': None}] * 40000)
sys.modules['sandkernel_variables'] = HugeListing()
"""


async def test_a_forged_variable_listing_is_a_clear_error_and_the_real_one_lists_again(arena):
    """The variable listing is whatever the kernel evaluates, and tenant code can replace what
    answers it: an answer that is not the listing's literal, or one larger than a listing can be,
    is an error that says so (never a 500, never a parse that holds the gateway), and with the
    real listing put back the same session lists its variables again."""
    variables = f"/api/sessions/{arena.attacker['id']}/variables"
    assert (await arena.attack(FORGED_LISTING))["status"] == "ok"
    status, body = await arena.gateway.request("GET", variables)
    assert status == 409 and body["error"] == "kernel_answer_invalid" and "did not parse" in body["message"], body
    # One too large to be worth parsing is refused by its size, before any parse.
    assert (await arena.attack(HUGE_LISTING))["status"] == "ok"
    status, body = await arena.gateway.request("GET", variables)
    assert status == 409 and body["error"] == "kernel_answer_invalid", body
    assert f"over the {MAX_LISTING_CHARS} a listing may be" in body["message"], body
    assert (await arena.attack("sys.modules['sandkernel_variables'] = real_listing"))["status"] == "ok"
    status, body = await arena.gateway.request("GET", variables)
    assert status == 200 and "listed_after" in {v["name"] for v in body}, (status, body)
