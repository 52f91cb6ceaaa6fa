"""A real ``jupyter server --gateway-url`` (jupyter_server's GatewayClient: what JupyterLab runs)
pointed at a test gateway, for the tests that drive a gateway the way JupyterLab does.

:func:`jupyter_server` starts it on a free loopback port, waits until its API answers (failing
with its log when it exits or takes over :data:`START_TIMEOUT`), and stops it on the way out
(SIGTERM, then SIGKILL after 30 s). Its output goes to a log file, read back in failure messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from .gateway_fixtures import ALICE, free_port

JUPYTER_TOKEN = "jupyter-test-token"  # what the browser (the test) shows jupyter server
START_TIMEOUT = 60.0  # seconds until its /api answers


@dataclass
class JupyterServer:
    """A running jupyter server: its URL, its process and its log."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    token: str = JUPYTER_TOKEN

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def log_tail(self, size: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-size:]

    def websocket_request(self, kernel_id: str, session_id: str) -> HTTPRequest:
        """The browser's request for a kernel's channels websocket."""
        ws_url = self.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels?session_id={session_id}"
        return HTTPRequest(ws_url, headers=self.headers)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, JSON body or None) of one request to jupyter server's REST API."""
        request = HTTPRequest(
            self.url + path,
            method=method,
            headers=self.headers,
            body=json.dumps(body) if body is not None else (b"" if method == "POST" else None),
            request_timeout=180,
        )
        response = await AsyncHTTPClient().fetch(request, raise_error=False)
        return response.code, json.loads(response.body) if response.body else None


@contextlib.asynccontextmanager
async def jupyter_server(gateway_url: str, root: Path, auth_token: str = ALICE) -> AsyncIterator[JupyterServer]:
    """jupyter server with ``--gateway-url=gateway_url``, its root dir (and log) in ``root``,
    reaching the gateway as the tenant of ``auth_token``; see the module docstring."""
    port = free_port()
    argv = [
        sys.executable, "-m", "jupyter_server", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1",
        f"--IdentityProvider.token={JUPYTER_TOKEN}", "--ServerApp.open_browser=False",
        "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root}", f"--gateway-url={gateway_url}",
        f"--GatewayClient.auth_token={auth_token}", "--GatewayClient.request_timeout=120",
    ]  # fmt: skip
    log_path = root / "jupyter-server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    server = JupyterServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                await AsyncHTTPClient().fetch(f"{server.url}/api", request_timeout=2)
                break
            except (HTTPClientError, OSError):
                assert proc.poll() is None, f"jupyter server exited:\n{server.log_tail()}"
                assert time.monotonic() < deadline, f"jupyter server did not answer:\n{server.log_tail()}"
                await asyncio.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
