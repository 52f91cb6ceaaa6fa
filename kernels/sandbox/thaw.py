"""Execs a sandbox stops before they run are killed while the gateway waits on that sandbox.

Why: a sandbox's code runs as the user a ``docker exec`` takes before it runs its program, so it
can SIGSTOP a helper while it is still runc's init. ``runc exec`` then waits for that init, and
dockerd with it, holding the container's lock: every later exec create, inspect and removal of
that container waits (a CI run saw a file listing's exec create wait 120 s, the engine client's
own timeout). Killing the stopped init ends the wait. Doing it only when a call times out is too
late (the next call's init is stopped again and every call pays the full wait), so while any
helper of a container is in flight a watcher looks every :data:`THAW_INTERVAL` seconds.

What is killed is only ever a process in this container's cgroup, named runc's init and stopped
(:func:`cgroup.kill_stopped_runc_inits`): the sandbox's own doing. Under gVisor no such process
exists on the host (nothing to do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from sandkernel.kernels.sandbox.cgroup import kill_stopped_runc_inits

log = logging.getLogger(__name__)

THAW_INTERVAL = 0.5


class InitWatch:
    """One container's watcher: runs while at least one caller is inside :meth:`during`."""

    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        self._callers = 0
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def during(self) -> AsyncIterator[None]:
        """Watch the container for stopped execs while the block runs."""
        self._callers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name=f"sandkernel-thaw-{self.container_id[:12]}")
        try:
            yield
        finally:
            self._callers -= 1
            if self._callers == 0 and self._task is not None:
                self._task.cancel()
                self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(THAW_INTERVAL)
            try:
                await asyncio.to_thread(kill_stopped_runc_inits, self.container_id)
            except Exception:  # best effort, never the caller's failure
                log.exception("looking for stopped execs failed", extra={"container": self.container_id[:12]})


__all__ = ["THAW_INTERVAL", "InitWatch"]
