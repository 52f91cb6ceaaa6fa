"""Trivial execute round trip, four ways, in one run:

- sandkernel session API (HTTP POST /api/sessions/{id}/execute, keep-alive connection)
- sandkernel kernel websocket (/api/kernels/{id}/channels, what JupyterLab uses)
- raw jupyter_client straight to the SAME kernel's ZMQ sockets (the floor: no gateway), its
  connection read from the gateway's catalog
- Jupyter Kernel Gateway 3 out of the box, serving a local (unsandboxed) ipykernel, over its websocket

The first three take turns in blocks (``--block`` round trips each, the first few of a block not
kept), so load and drift on a shared machine hit them alike; only one of them is connected to
the kernel at a time. ``--before TREE`` adds the same two gateway doors of another checkout
(its own gateway process, session and kernel, same image) to the turns, for before/after numbers
from one run; TREE needs a virtualenv in TREE/.venv that imports sandkernel from TREE.

Prints p50/p95 and the ratios the issue asks for; writes bench/results/execute_roundtrip.json.
Usage: python bench/execute_roundtrip.py [--n 200] [--before TREE]  (Kernel Gateway row if installed)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from jupyter_client.asynchronous.client import AsyncKernelClient
from results_dir import results_path
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

TOKEN = "bench-token-" + uuid.uuid4().hex
RAW = "raw jupyter_client (sandkernel kernel)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p95_ms": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000,
        "n": len(ordered),
    }


async def interleaved(
    calls: dict[str, Callable[[], Awaitable[object]]], n: int, warmup: int = 5
) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, called round by round in turn (so drift, load and
    caches hit all alike); the first ``warmup`` rounds are not kept."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_number in range(n + warmup):
        for name, call in calls.items():
            began = time.perf_counter()
            await call()
            if round_number >= warmup:
                samples[name].append(time.perf_counter() - began)
    return samples


async def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2:4]} exited with {proc.returncode}")
        try:
            await AsyncHTTPClient().fetch(url, request_timeout=2)
            return
        except Exception:  # not up yet
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def api(base: str, method: str, path: str, token: str, body=None) -> dict:
    req = HTTPRequest(
        base + path,
        method=method,
        headers={"Authorization": f"token {token}"},
        body=json.dumps(body) if body is not None else None,
        request_timeout=180,
    )
    return json.loads((await AsyncHTTPClient().fetch(req)).body)


def session_api_round_trips(port: int, session_id: str, n: int, warmup: int = 10) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    body = json.dumps({"code": "1+1"})
    headers = {"Authorization": f"token {TOKEN}", "Content-Type": "application/json"}
    samples = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        conn.request("POST", f"/api/sessions/{session_id}/execute", body, headers)
        reply = json.loads(conn.getresponse().read())
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
        assert reply["status"] == "ok", reply
    conn.close()
    return samples


async def websocket_round_trips(ws_url: str, token: str, n: int, warmup: int = 10) -> list[float]:
    ws = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}))
    samples = []
    for i in range(n + warmup):
        msg_id = uuid.uuid4().hex
        msg = {
            "header": {
                "msg_id": msg_id,
                "msg_type": "execute_request",
                "username": "b",
                "session": "b",
                "version": "5.3",
                "date": "2026-01-01T00:00:00Z",
            },
            "parent_header": {},
            "metadata": {},
            "channel": "shell",
            "content": {
                "code": "1+1",
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": True,
            },
        }
        t0 = time.perf_counter()
        await ws.write_message(json.dumps(msg))
        got_reply = got_idle = False
        while not (got_reply and got_idle):
            data = json.loads(await ws.read_message())
            if data.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            got_reply |= data["header"]["msg_type"] == "execute_reply"
            got_idle |= data["header"]["msg_type"] == "status" and data["content"]["execution_state"] == "idle"
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    ws.close()
    return samples


def kernel_connection(state_dir: str, session_id: str) -> dict:
    """The connection info of a session's kernel, from its gateway's catalog (read-only)."""
    db = sqlite3.connect(f"file:{Path(state_dir) / 'catalog.sqlite3'}?mode=ro", uri=True)
    try:
        (kernel,) = db.execute("SELECT kernel FROM sandboxes WHERE session_id = ?", (session_id,)).fetchone()
    finally:
        db.close()
    return json.loads(kernel)["connection_info"]


async def raw_client_round_trips(connection: dict, n: int, warmup: int = 10) -> list[float]:
    """Round trips of a plain jupyter_client connected straight to the kernel's sockets."""
    client = AsyncKernelClient()
    client.load_connection_info(connection)
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        samples = []
        for i in range(n + warmup):
            t0 = time.perf_counter()
            reply = await client.execute_interactive("1+1", timeout=60, output_hook=lambda m: None)
            if i >= warmup:
                samples.append(time.perf_counter() - t0)
            assert reply["content"]["status"] == "ok"
        return samples
    finally:
        client.stop_channels()


class ServedGateway:
    """``sandkernel serve`` of one checkout (no pool), with a private catalog, and one session."""

    def __init__(self, python: str, cwd: str | None) -> None:
        self.python, self.cwd = python, cwd
        self.port = free_port()
        self.state = tempfile.mkdtemp(prefix="sandkernel-bench-state-")  # sandboxes removed on exit
        self.notebooks = tempfile.mkdtemp(prefix="sandkernel-bench-notebooks-")  # one gateway each
        self.proc: subprocess.Popen | None = None

    async def __aenter__(self) -> ServedGateway:
        # fmt: off
        command = [self.python, "-m", "sandkernel.cli", "serve", "--port", str(self.port), "--token", TOKEN,
                   "--pool-size", "0", "--on-exit", "delete", "--state-dir", self.state,
                   "--notebook-dir", self.notebooks]
        # fmt: on
        base = f"http://127.0.0.1:{self.port}"
        for attempt in range(3):  # a start can fail while other processes remove containers
            self.proc = subprocess.Popen(command, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                await wait_http(base + "/api/health", self.proc)
                break
            except RuntimeError:
                self.proc.kill()  # a no-op on one that exited
                self.proc.wait()
                if attempt == 2:
                    raise
        session = await api(base, "POST", "/api/sessions", TOKEN, {})
        self.session_id, self.kernel_id = session["id"], session["kernel"]["id"]
        self.ws_url = f"ws://127.0.0.1:{self.port}/api/kernels/{self.kernel_id}/channels"
        return self

    def cpu_seconds(self) -> float:
        """CPU time the gateway process has used so far (all its threads; Linux /proc). Unlike
        latency, CPU per round trip hardly moves when other work loads the machine."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        await asyncio.to_thread(self.proc.wait, 60)
        # The gateway removed its sandboxes on exit; its catalog and transcripts go too.
        for directory in (self.state, self.notebooks):
            shutil.rmtree(directory, ignore_errors=True)


async def gateway_doors(n: int, block: int, before: str | None) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Samples of each door (and raw jupyter_client on the same kernel), in rotating blocks; and
    the gateway's CPU milliseconds per round trip of each door."""
    async with contextlib.AsyncExitStack() as stack:
        now = await stack.enter_async_context(ServedGateway(sys.executable, None))
        gateways = {"sandkernel session API": now, "sandkernel websocket": now}
        calls: dict[str, Callable[[int], Awaitable[list[float]]]] = {
            "sandkernel session API": lambda m: asyncio.to_thread(
                session_api_round_trips, now.port, now.session_id, m, 3
            ),
            "sandkernel websocket": lambda m: websocket_round_trips(now.ws_url, TOKEN, m, 3),
            RAW: lambda m: raw_client_round_trips(kernel_connection(now.state, now.session_id), m, 3),
        }
        if before:
            then = await stack.enter_async_context(ServedGateway(str(Path(before) / ".venv/bin/python"), before))
            calls["before: sandkernel session API"] = lambda m: asyncio.to_thread(
                session_api_round_trips, then.port, then.session_id, m, 3
            )
            calls["before: sandkernel websocket"] = lambda m: websocket_round_trips(then.ws_url, TOKEN, m, 3)
            gateways |= {"before: sandkernel session API": then, "before: sandkernel websocket": then}
        samples: dict[str, list[float]] = {name: [] for name in calls}
        cpu: dict[str, float] = dict.fromkeys(gateways, 0.0)
        names = list(calls)
        round_number = 0
        while min(len(s) for s in samples.values()) < n:
            for name in names[round_number % len(names) :] + names[: round_number % len(names)]:
                used = gateways[name].cpu_seconds() if name in gateways else 0.0
                count = min(block, n - len(samples[name])) or 1
                samples[name].extend(await calls[name](count))
                if name in gateways:
                    cpu[name] += gateways[name].cpu_seconds() - used
            round_number += 1
        trips = {name: len(samples[name]) + 3 * -(-len(samples[name]) // block) for name in cpu}  # with warm-ups
        return samples, {name: 1000 * cpu[name] / trips[name] for name in cpu}


async def kernel_gateway_round_trips(n: int) -> list[float]:
    kg_port = free_port()
    kg_token = uuid.uuid4().hex
    kg = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kernel_gateway",
            f"--KernelGatewayApp.port={kg_port}",
            "--KernelGatewayApp.ip=127.0.0.1",
            f"--KernelGatewayApp.auth_token={kg_token}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    try:
        kg_base = f"http://127.0.0.1:{kg_port}"
        await wait_http(kg_base + f"/api?token={kg_token}", kg)
        kernel = await api(kg_base, "POST", "/api/kernels", kg_token, {"name": "python3"})
        return await websocket_round_trips(f"ws://127.0.0.1:{kg_port}/api/kernels/{kernel['id']}/channels", kg_token, n)
    finally:
        kg.terminate()
        kg.wait(60)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="round trips kept per contender")
    parser.add_argument("--block", type=int, default=25, help="round trips per turn (3 more not kept)")
    parser.add_argument("--before", help="another checkout whose gateway doors join the turns")
    args = parser.parse_args()
    samples, cpu_ms = await gateway_doors(args.n, args.block, args.before)
    results = {name: stats(values) for name, values in samples.items()}
    for name, ms in cpu_ms.items():
        results[name]["gateway_cpu_ms"] = ms
    if shutil.which("jupyter-kernelgateway") or _has_module("kernel_gateway"):
        results["Kernel Gateway 3 websocket (local kernel)"] = stats(await kernel_gateway_round_trips(args.n))
    raw = results[RAW]["p50_ms"]
    print(f"{'path':45} {'p50 ms':>8} {'p95 ms':>8} {'vs raw':>7} {'gateway CPU ms/trip':>20}")
    for name, row in results.items():
        cpu = f"{row['gateway_cpu_ms']:20.2f}" if "gateway_cpu_ms" in row else ""
        print(f"{name:45} {row['p50_ms']:8.2f} {row['p95_ms']:8.2f} {row['p50_ms'] / raw:6.2f}x {cpu}")
    if "Kernel Gateway 3 websocket (local kernel)" in results:
        kg_ratio = (
            results["Kernel Gateway 3 websocket (local kernel)"]["p50_ms"] / results["sandkernel websocket"]["p50_ms"]
        )
        print(f"\nsandkernel websocket is {kg_ratio:.1f}x faster than Kernel Gateway 3 out of the box (p50)")
    out = results_path("execute_roundtrip.json")
    kept = {name: row for name, row in results.items() if not name.startswith("before: ")}
    out.write_text(json.dumps({"n": args.n, "cpus": os.cpu_count(), "results": kept}, indent=2))
    print(f"written: {out}")


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    asyncio.run(main())
