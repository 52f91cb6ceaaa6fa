"""A gateway served from the benchmark's own event loop, on a free loopback port, with its
notebooks in a temporary directory: what every gateway benchmark needs, in one place."""

from __future__ import annotations

import contextlib
import json
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from sandkernel.gateway.server import Gateway
from sandkernel.gateway.settings import GatewaySettings

TOKEN = "bench-token-0123456789abcdef"


@contextlib.asynccontextmanager
async def inprocess_gateway(**options: Any) -> AsyncIterator[int]:
    """Yields the port; every session is removed when the block ends. ``options`` are
    GatewaySettings fields; the warm pool is off unless asked for (``pool_size=N``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as notebooks, tempfile.TemporaryDirectory() as state:
        # A private catalog, and every sandbox removed on exit: a benchmark leaves nothing running.
        defaults = {"pool_size": 0, "on_exit": "delete", "state_dir": Path(state)}
        settings = GatewaySettings(
            ip="127.0.0.1", port=port, token=TOKEN, notebook_dir=Path(notebooks), **{**defaults, **options}
        )
        async with await Gateway.start(settings):
            yield port


class GatewayApi:
    """JSON calls to a benchmark's gateway with its token (one HTTP client, many connections)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.http = AsyncHTTPClient(force_instance=True, max_clients=200)

    async def __call__(self, method: str, path: str, body: dict | None = None) -> dict:
        request = HTTPRequest(
            f"http://127.0.0.1:{self.port}{path}",
            method=method,
            body=json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None),
            headers={"Authorization": f"token {TOKEN}"},
            request_timeout=600,
        )
        response = await self.http.fetch(request)
        return json.loads(response.body) if response.body else {}

    async def execute(self, sid: str, code: str) -> dict:
        return await self("POST", f"/api/sessions/{sid}/execute", {"code": code, "timeout": 120})
