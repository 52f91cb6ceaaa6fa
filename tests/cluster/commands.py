"""The swarm lab's one error and its two primitives: run a command, wait for a condition."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class LabError(RuntimeError):
    """The lab could not be built, driven or torn down; the message says which step and why."""


def run(cmd: Sequence[str], *, check: bool = True, timeout: float = 60.0, env: dict[str, str] | None = None,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command, text in and out; LabError (with its stderr) if it fails and ``check``, or
    if it does not finish within ``timeout`` seconds."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, input=input)
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{' '.join(cmd)}: no answer within {timeout} s") from exc
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def wait_for(what: str, ready: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T:
    """Poll ``ready()`` until it returns something truthy (returned), or LabError after
    ``timeout`` seconds. The lab's events (a socket answering, a node Ready, a task Running) have
    no notification to wait on, so this is the one place that polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise LabError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
