"""A real gateway on a loopback port, in the test's event loop, with two tenants."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from sandkernel.gateway.budget import OutputBudget
from sandkernel.gateway.server import serve

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    url: str
    port: int
    stop: asyncio.Event
    task: asyncio.Task

    async def request(
        self, method: str, path: str, body: Any = None, token: str | None = ALICE, raw: bytes | None = None, **kw: Any
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"token {token}"} if token else {}
        headers.update(kw.pop("headers", {}))
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if method in ("POST", "PUT") and data is None:
            data = b""
        req = HTTPRequest(self.url + path, method=method, body=data, headers=headers, request_timeout=300, **kw)
        try:
            resp = await AsyncHTTPClient().fetch(req)
        except HTTPClientError as err:
            resp = err.response
        text = resp.body.decode() if resp.body else ""
        try:
            return resp.code, json.loads(text) if text else None
        except ValueError:
            return resp.code, text


async def start_gateway(tmp_path, budget: OutputBudget | None = None, **options: Any) -> Gateway:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alice": ALICE, "bob": BOB}))
    tokens.chmod(0o600)  # the gateway refuses a tokens file others can read
    port = free_port()
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        serve(
            "127.0.0.1",
            port,
            tokens_file=str(tokens),
            budget=budget,
            ready=ready,
            stop=stop,
            **{"max_sessions": 4, "default_runtime": "runc", **options},
        )
    )
    await asyncio.wait_for(ready.wait(), 60)
    return Gateway(f"http://127.0.0.1:{port}", port, stop, task)


async def stop_gateway(gateway: Gateway) -> None:
    gateway.stop.set()
    await asyncio.wait_for(gateway.task, 120)


def rss_mib() -> float:
    """This process's resident memory (the in-process gateway's)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class PeakRss:
    """``async with PeakRss() as rss:`` samples this process's RSS every 50 ms; ``rss.growth`` is
    the peak minus the RSS at entry, in MiB."""

    async def __aenter__(self) -> PeakRss:
        self.baseline = self.peak = rss_mib()
        self._task = asyncio.create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mib())
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        self.peak = max(self.peak, rss_mib())

    @property
    def growth(self) -> float:
        return self.peak - self.baseline
