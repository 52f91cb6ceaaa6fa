"""One ``sandkernel serve`` process for a bench: its own state dir, sandboxes deleted on exit,
and its log kept so a failure says why.

Why a log and not DEVNULL: a gateway that exits at start (exit 2: a setting it refuses, a port
taken meanwhile) or leaves something behind at its stop would otherwise fail the bench with no
clue. The log's tail is in every error this raises. A workspace still mounted in the state dir
after the gateway exited is a defect of the gateway's stop: it is reported with that tail, and
unmounted first, so the bench's temp dir can go and the machine keeps nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from execute_roundtrip import free_port, wait_http

from sandkernel.agent.client import AsyncSandkernel
from sandkernel.gateway.auth import new_token

LOG_TAIL_CHARS = 4000
STOP_SECONDS = 180


def log_tail(log: Path) -> str:
    """The end of a gateway's log (what it said last), for an error message."""
    try:
        return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError as err:
        return f"(no log: {err})"


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or under ``directory`` in this process's mount table."""
    prefix = str(directory.resolve())
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def unmount_all(points: list[str]) -> None:
    """Lazily unmount what a gateway left, deepest first (a workspace's loop device was set up
    with autoclear: it goes with its last mount)."""
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@contextlib.asynccontextmanager
async def served_gateway(
    flags: list[str], request_timeout: float = 300, tokens: dict[str, str] | None = None
) -> AsyncIterator[AsyncSandkernel]:
    """A gateway process started with ``flags`` (after the bench's common ones) and a client for
    it. On exit: SIGTERM, then a check that it left no mount in its state dir.

    ``tokens`` ({"tenant": "token"}): several tenants, from a --tokens-file (mode 0600) instead of
    one --token; the client holds the first tenant's token, the others' clients are
    ``AsyncSandkernel(client.url, token)``."""
    port = free_port()
    token = next(iter(tokens.values())) if tokens else new_token()
    with tempfile.TemporaryDirectory(prefix="sandkernel-bench-") as state:
        log = Path(state).with_suffix(".log")
        tokens_file = Path(state).with_suffix(".tokens.json")
        command = [sys.executable, "-m", "sandkernel.cli", "serve", "--port", str(port)]
        command += ["--tokens-file", str(tokens_file)] if tokens else [f"--token={token}"]
        command += ["--state-dir", state, "--notebook-dir", f"{state}/notebooks", "--pool-size", "0"]
        command += ["--on-exit", "delete", *flags]
        try:
            if tokens:
                with os.fdopen(os.open(tokens_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                    json.dump(tokens, f)
            with log.open("wb") as out:
                proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                try:
                    await wait_http(f"{url}/api/health", proc)
                except RuntimeError as err:
                    raise RuntimeError(f"{err}; its log ends:\n{log_tail(log)}") from None
                async with AsyncSandkernel(url, token, request_timeout=request_timeout) as client:
                    yield client
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(STOP_SECONDS)
            left = mounts_under(Path(state))
            if left:
                unmount_all(left)
                raise RuntimeError(f"the gateway exited with {left} still mounted; its log ends:\n{log_tail(log)}")
        finally:
            log.unlink(missing_ok=True)
            tokens_file.unlink(missing_ok=True)
