"""Trivial execute round trip, four ways, in one run:

- sandkernel session API (HTTP POST /api/sessions/{id}/execute, keep-alive connection)
- sandkernel kernel websocket (/api/kernels/{id}/channels, what JupyterLab uses)
- raw jupyter_client straight to a sandkernel kernel's ZMQ sockets (the floor: no gateway)
- Jupyter Kernel Gateway 3 out of the box, serving a local (unsandboxed) ipykernel, over its websocket

Prints p50/p95 and the ratios the issue asks for; writes bench/results/execute_roundtrip.json.
Usage: python bench/execute_roundtrip.py [--n 200]  (needs jupyter_kernel_gateway for the last row)
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable

from results_dir import results_path
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

from sandkernel.kernels.execution.session import KernelSession

TOKEN = "bench-token-" + uuid.uuid4().hex


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


def session_api_round_trips(port: int, session_id: str, n: int) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    body = json.dumps({"code": "1+1"})
    headers = {"Authorization": f"token {TOKEN}", "Content-Type": "application/json"}
    samples = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        conn.request("POST", f"/api/sessions/{session_id}/execute", body, headers)
        reply = json.loads(conn.getresponse().read())
        if i >= 10:  # warm-up
            samples.append(time.perf_counter() - t0)
        assert reply["status"] == "ok", reply
    conn.close()
    return samples


async def websocket_round_trips(ws_url: str, token: str, n: int) -> list[float]:
    ws = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}))
    samples = []
    for i in range(n + 10):
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
        if i >= 10:
            samples.append(time.perf_counter() - t0)
    ws.close()
    return samples


async def raw_client_round_trips(n: int) -> list[float]:
    async with await KernelSession.start() as session:
        client = session.kernel_manager.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        samples = []
        for i in range(n + 10):
            t0 = time.perf_counter()
            reply = await client.execute_interactive("1+1", timeout=60, output_hook=lambda m: None)
            if i >= 10:
                samples.append(time.perf_counter() - t0)
            assert reply["content"]["status"] == "ok"
        client.stop_channels()
        return samples


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200, help="round trips per contender (after 10 warm-up)")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    port = free_port()
    state = tempfile.mkdtemp(prefix="sandkernel-bench-state-")  # a private catalog; sandboxes removed on exit
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandkernel.cli",
            "serve",
            "--port",
            str(port),
            "--token",
            TOKEN,
            "--pool-size",
            "0",
            "--on-exit",
            "delete",
            "--state-dir",
            state,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_http(base + "/api/health", gateway)
        session = await api(base, "POST", "/api/sessions", TOKEN, {})
        results["sandkernel session API"] = stats(
            await asyncio.to_thread(session_api_round_trips, port, session["id"], args.n)
        )
        ws_url = f"ws://127.0.0.1:{port}/api/kernels/{session['kernel']['id']}/channels"
        results["sandkernel websocket"] = stats(await websocket_round_trips(ws_url, TOKEN, args.n))
    finally:
        gateway.terminate()
        gateway.wait(60)
    results["raw jupyter_client (sandkernel kernel)"] = stats(await raw_client_round_trips(args.n))
    if shutil.which("jupyter-kernelgateway") or _has_module("kernel_gateway"):
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
            kg_ws = f"ws://127.0.0.1:{kg_port}/api/kernels/{kernel['id']}/channels"
            results["Kernel Gateway 3 websocket (local kernel)"] = stats(
                await websocket_round_trips(kg_ws, kg_token, args.n)
            )
        finally:
            kg.terminate()
            kg.wait(60)
    raw = results["raw jupyter_client (sandkernel kernel)"]["p50_ms"]
    print(f"{'path':45} {'p50 ms':>8} {'p95 ms':>8} {'vs raw':>7}")
    for name, row in results.items():
        print(f"{name:45} {row['p50_ms']:8.2f} {row['p95_ms']:8.2f} {row['p50_ms'] / raw:6.2f}x")
    if "Kernel Gateway 3 websocket (local kernel)" in results:
        kg_ratio = (
            results["Kernel Gateway 3 websocket (local kernel)"]["p50_ms"] / results["sandkernel websocket"]["p50_ms"]
        )
        print(f"\nsandkernel websocket is {kg_ratio:.1f}x faster than Kernel Gateway 3 out of the box (p50)")
    out = results_path("execute_roundtrip.json")
    out.write_text(json.dumps({"n": args.n, "cpus": os.cpu_count(), "results": results}, indent=2))
    print(f"written: {out}")


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    asyncio.run(main())
