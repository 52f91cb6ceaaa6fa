"""A kernel flooding mis-signed iopub messages at an open kernel websocket must not hold the
gateway's event loop.

The websocket relay (gateway/channels.py ``_relay``) verifies every kernel message and drops
the mis-signed ones. It took every queued message in one loop of DONTWAIT receives until 7d54615:
such a receive is complete at once and a dropped message awaits nothing, so the loop yielded only
when its queue ran dry; a kernel refilling the queue faster than the gateway verifies would hold
the loop and freeze every session of every tenant. The relay now takes a bounded batch, yielding
after each message. Here the attacker (tenant alice) floods its own kernel's iopub from a thread
while a websocket is open on it; meanwhile the canary (tenant bob) executes ``1+1`` through the
session API and ``/api/health`` is asked, each within a liveness bound, and a probe task measures
the longest stall of the event loop (the gateway runs in this test's loop, so a held loop is
seen directly). The arena then checks nothing else was harmed.

A guard of the property, not a reproduction of the old hold: the relay's subscriber queue holds
two messages (transport.IOPUB_RECEIVE_QUEUE) and each refill is a round trip through ZMQ's I/O
thread, so on the 2-core CI host the old loop also found its queue dry every few messages and this
test passed against it too (small, 64 KiB, 256 KiB and 1 MiB junk, runc).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from sandkernel.gateway import channels

from ..gateway_fixtures import ALICE
from ..test_gateway import execute_request, ws_execute

pytestmark = [pytest.mark.security, pytest.mark.docker, pytest.mark.slow]

FLOOD_SECONDS = 15
# The flood starts after its cell returned, so the cell's own idle status is not lost in it.
FLOOD_DELAY_SECONDS = 1.0
# Messages the kernel's iopub thread sends per scheduled burst (the flooding thread waits for
# each burst before the next, so the kernel's memory stays flat: only the sending is tight).
BURST = 200
# Each junk message carries this much text, so verifying it (an HMAC over the text) is real work
# for the gateway on every message.
JUNK_BYTES = 64 * 1024
# Liveness bounds, generous on purpose (a loaded 2-core machine): a held loop would stall for the
# whole flood (FLOOD_SECONDS); a served one stalled 0.05 s (runc) and 0.5 s (runsc) here.
CANARY_BOUND_SECONDS = 10.0
HEALTH_BOUND_SECONDS = 10.0
MAX_LOOP_STALL_SECONDS = 5.0
MIN_CANARY_SAMPLES = 3
# The flood must have reached the relay for the test to mean anything.
MIN_DROPPED_AT_RELAY = 500

FLOOD = f"""
import threading, time, zmq
from ipykernel.kernelbase import Kernel
_kernel = Kernel.instance()
_iopub = _kernel.iopub_thread
_parts = [_kernel.session.pack(p) for p in
          (_kernel.session.msg_header("stream"), {{}}, {{}}, {{"name": "stdout", "text": "J" * {JUNK_BYTES}}})]
flood_sent = 0
def _burst(done):
    # runs in the iopub thread (the socket is its own); returns when the subscribers' queues are
    # full (XPUB_NODROP: the send refuses instead of dropping) so the kernel's CPU is not spent
    # on messages nobody will receive
    global flood_sent
    try:
        for _ in range({BURST}):
            # a new wrong signature each time: the gateway pays an HMAC per message, not a lookup
            _iopub.socket.send_multipart(
                [b"stream.stdout", b"<IDS|MSG>", b"%064x" % flood_sent, *_parts], flags=zmq.NOBLOCK, copy=False
            )
            flood_sent += 1
    except zmq.Again:
        pass
    finally:
        done.set()
def _flood():
    time.sleep({FLOOD_DELAY_SECONDS})
    _iopub.schedule(lambda: _iopub.socket.setsockopt(zmq.XPUB_NODROP, 1))
    until = time.monotonic() + {FLOOD_SECONDS}
    while time.monotonic() < until:
        done = threading.Event()
        _iopub.schedule(lambda: _burst(done))
        done.wait(5)
        time.sleep(0.001)
    _iopub.schedule(lambda: _iopub.socket.setsockopt(zmq.XPUB_NODROP, 0))
flooder = threading.Thread(target=_flood, daemon=True)
flooder.start()
print('flooding')
"""


class DroppedCounter(logging.Filter):
    """Counts the messages the relay dropped, from its warnings: it logs one line at most every
    10 s (logs.Throttle) saying how many it kept quiet since, so a kernel cannot make it write a
    line per junk message (a thousand a second fills the operator's log disk). ``lines``: the
    warning lines it did write."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0
        self.lines = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and "failed verification" in str(record.msg):
            skipped = record.args[-1] if isinstance(record.args, tuple) and record.args else 0
            self.lines += 1
            self.dropped += 1 + (skipped if isinstance(skipped, int) else 0)
        return True


class LoopStall:
    """``async with LoopStall() as stall:`` wakes every 50 ms; ``stall.worst`` is the longest
    time the event loop took to wake it (seconds): how long the loop was held by something."""

    TICK = 0.05

    async def __aenter__(self) -> LoopStall:
        self.worst = 0.0
        self._task = asyncio.create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.TICK)
            self.worst = max(self.worst, time.monotonic() - before - self.TICK)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()


async def _open_websocket(arena) -> object:
    """A websocket on the attacker's kernel whose iopub subscription is live (one round trip)."""
    url = (
        f"ws://127.0.0.1:{arena.gateway.port}/api/kernels/{arena.attacker['kernel']['id']}/channels"
        f"?session_id={uuid.uuid4().hex}"
    )
    conn = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {ALICE}"}))
    probe = execute_request("")
    probe["header"]["msg_type"] = "kernel_info_request"
    probe["content"] = {}
    await conn.write_message(json.dumps(probe))
    while True:
        frame = await asyncio.wait_for(conn.read_message(), 60)
        assert frame is not None, "the websocket closed before its first reply"
        message = json.loads(frame)
        if (
            message.get("parent_header", {}).get("msg_id") == probe["header"]["msg_id"]
            and message["channel"] == "shell"
        ):
            return conn


async def _flood_count(arena) -> int:
    """The kernel's count of junk messages sent, once its output reaches the gateway again.

    Right after the flood the subscribers' queues can still be full of junk not yet read and
    dropped, and with XPUB_NODROP off again the kernel's PUB socket drops what it sends to a full
    subscriber: the first cell's output can be lost (seen once in CI: status ok, no text). The
    queues drain within the flood's own length, so that is the deadline."""
    deadline = time.monotonic() + FLOOD_SECONDS
    while True:
        reply = await arena.attack("print(flood_sent)")
        assert reply["status"] == "ok", reply
        if reply["text"].strip().isdigit():
            return int(reply["text"])
        assert time.monotonic() < deadline, f"no output reached the gateway {FLOOD_SECONDS} s after the flood"


async def test_a_mis_signed_iopub_flood_on_a_websocket_does_not_freeze_other_sessions(arena):
    await arena.attack("print('idle')")  # earlier attacks are over
    counter = DroppedCounter()
    relay_log = logging.getLogger(channels.__name__)
    relay_log.addFilter(counter)
    conn = await _open_websocket(arena)
    try:
        canary, health = [], []
        async with LoopStall() as stall:
            started = await arena.attack(FLOOD)
            assert started["status"] == "ok" and started["text"] == "flooding\n", started
            flood_over = time.monotonic() + FLOOD_DELAY_SECONDS + FLOOD_SECONDS
            while time.monotonic() < flood_over:
                began = time.monotonic()
                reply = await arena.canary_run("1+1")
                canary.append(time.monotonic() - began)
                results = [o["data"]["text/plain"] for o in reply["outputs"] if o["output_type"] == "execute_result"]
                assert reply["status"] == "ok" and results == ["2"], reply
                began = time.monotonic()
                status, body = await arena.gateway.request("GET", "/api/health", token=None)
                health.append(time.monotonic() - began)
                assert status == 200 and body["status"] == "ok", body
                await asyncio.sleep(0.5)
        joined = await arena.attack("flooder.join()")
        assert joined["status"] == "ok", joined
        sent = await _flood_count(arena)
        print(
            f"{arena.runtime}: kernel sent {sent} mis-signed messages, the relay dropped {counter.dropped}; "
            f"canary 1+1 took max {max(canary):.2f} s over {len(canary)}, health max {max(health):.2f} s, "
            f"longest loop stall {stall.worst:.2f} s"
        )
        assert counter.dropped >= MIN_DROPPED_AT_RELAY, f"the flood never reached the relay ({counter.dropped})"
        assert counter.lines <= 4, f"the relay wrote {counter.lines} warning lines for one flood (not throttled)"
        assert stall.worst < MAX_LOOP_STALL_SECONDS, f"the gateway's event loop was held for {stall.worst:.1f} s"
        assert len(canary) >= MIN_CANARY_SAMPLES, f"only {len(canary)} canary executes during the flood: {canary}"
        assert max(canary) < CANARY_BOUND_SECONDS, f"a canary 1+1 took {max(canary):.1f} s during the flood: {canary}"
        assert max(health) < HEALTH_BOUND_SECONDS, f"/api/health took {max(health):.1f} s during the flood"
        # The attacker's websocket and kernel still work once the flood is over.
        _, reply = await ws_execute(conn, "1+1")
        assert reply["content"]["status"] == "ok", reply
    finally:
        conn.close()
        relay_log.removeFilter(counter)
