"""A gateway served from the benchmark's own event loop, on a free loopback port, with its
notebooks in a temporary directory: what every gateway benchmark needs, in one place."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sandkernel.gateway.server import serve

TOKEN = "bench-token-0123456789abcdef"


@contextlib.asynccontextmanager
async def inprocess_gateway(**options: Any) -> AsyncIterator[int]:
    """Yields the port; every session is removed when the block ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ready, stop = asyncio.Event(), asyncio.Event()
    with tempfile.TemporaryDirectory() as notebooks:
        task = asyncio.create_task(
            serve(
                "127.0.0.1",
                port,
                TOKEN,
                ready=ready,
                stop=stop,
                announce=False,
                notebook_dir=Path(notebooks),
                **options,
            )
        )
        await ready.wait()
        try:
            yield port
        finally:
            stop.set()
            await task
