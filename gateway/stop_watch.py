"""A gateway's stop, bounded: SIGTERM ends the process within its shutdown grace plus a margin,
whatever a tenant's sandbox or a lost dependency does, and a stop that overruns says where it
waits before the process ends.

Why: every step of a stop is bounded on its own (executions get the grace, helpers their
deadlines, catalog calls their timeouts), but a step that waits on something unforeseen would
leave a gateway that no longer listens yet never exits: an operator's restart then hangs, and
nothing says why. A CI rehearsal saw it once (a cluster gateway silent for 120 s after SIGTERM).
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import os
import sys
from collections.abc import Awaitable

log = logging.getLogger(__name__)

# Time a stop may take beyond --shutdown-grace: removing containers, closing the catalog, the
# audit log's last records. Past it the process ends anyway (exit code STOP_OVERRAN_EXIT).
STOP_MARGIN_SECONDS = 60.0
STOP_OVERRAN_EXIT = 3


def pending_tasks() -> str:
    """Every task of the running loop but the caller's, each with where it waits."""
    out = io.StringIO()
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is current:
            continue
        out.write(f"task {task.get_name()}:\n")
        task.print_stack(limit=12, file=out)
    return out.getvalue()


async def bounded_stop(stopping: Awaitable[None], grace: float) -> None:
    """Await ``stopping``; if it takes longer than ``grace`` plus :data:`STOP_MARGIN_SECONDS`,
    log the tasks and threads still waiting and end the process (its sandboxes are left to the
    next gateway's adoption and reaper, as after a crash)."""
    limit = grace + STOP_MARGIN_SECONDS
    task = asyncio.ensure_future(stopping)
    done, _ = await asyncio.wait({task}, timeout=limit)
    if done:
        task.result()
        return
    log.error("the gateway did not stop within %.0f s; ending the process. Waiting:\n%s", limit, pending_tasks())
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(STOP_OVERRAN_EXIT)  # threads blocked in a call would hold an orderly exit too


__all__ = ["STOP_MARGIN_SECONDS", "STOP_OVERRAN_EXIT", "bounded_stop", "pending_tasks"]
