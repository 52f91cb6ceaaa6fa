"""A gateway in this process, for commands that need one and have none to talk to.

``sandkernel agent`` (without ``--url``), ``sandkernel demo`` and the agent benchmark run a task
against a gateway on a loopback port with a fresh token, stopped when the task ends. It lives in
the CLI layer, not in ``agent/``: the agent is a client library and must not pull in the server.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sandkernel.agent.client import AsyncSandkernel
from sandkernel.gateway.auth import new_token
from sandkernel.gateway.server import Gateway
from sandkernel.gateway.settings import GatewaySettings

# One task needs one sandbox, started when the task begins: a warm pool would only start
# sandboxes nobody uses. The task's sandbox ends with it (on_exit delete), and its catalog is the
# gateway's own (a private state dir): a `sandkernel serve` of the same user keeps its catalog
# and sessions to itself, and this gateway never adopts them. No audit stream: it would go in
# that private state dir, deleted with it; the task's transcript is its record.
LOCAL_DEFAULTS: dict[str, Any] = {"pool_size": 0, "on_exit": "delete", "audit": False}


def free_port() -> int:
    """A loopback port free now (the gateway binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.asynccontextmanager
async def local_gateway(notebook_dir: Path | None = None, **options: Any) -> AsyncIterator[AsyncSandkernel]:
    """A gateway in this process (loopback, fresh token) and a client for it; stopped on exit.
    ``options`` are :class:`GatewaySettings` fields (``default_runtime="runsc"``, ...)."""
    token = new_token()
    with tempfile.TemporaryDirectory(prefix="sandkernel-local-") as state:
        settings = GatewaySettings(
            ip="127.0.0.1",
            port=free_port(),
            token=token,
            notebook_dir=notebook_dir,
            **{**LOCAL_DEFAULTS, "state_dir": Path(state), **options},
        )
        async with await Gateway.start(settings) as gateway, AsyncSandkernel(gateway.url, token) as client:
            yield client
