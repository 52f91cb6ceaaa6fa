"""A cluster member's stop ends its heartbeat even when a cancellation is lost inside a beat.

Seen in a full run: ``test_cluster_catalog_outage.py`` hung in ``ClusterMembership.stop`` until
pytest-timeout's 300 s, its heartbeat task back asleep in ``_beat_forever`` after the stop's one
cancel. A cancellation can be lost there: Python 3.11's ``asyncio.wait_for`` returns the inner
call's result when that call finishes just as the cancel lands. That race cannot be caused on
demand, so this test loses the cancellation the way a swallowing callee does: the catalog says
the host had been marked down, and the host's ``on_return`` (awaited directly by the beat)
swallows the cancel. The catalog is the one stand-in here, for that fault only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sandkernel.gateway.cluster.membership import ClusterMembership

STOP_BOUND_SECONDS = 10.0  # 20 rounds of CANCEL_AGAIN_SECONDS; before the fix the stop never returned


class MarkedDownCatalog:
    """Every heartbeat answers "this host had been marked down", so each beat awaits on_return."""

    def __init__(self) -> None:
        self.left = False

    @property
    def store(self) -> MarkedDownCatalog:
        return self

    async def check_host_lock(self) -> None:
        return None

    async def register(
        self, url: str, runtimes: Sequence[str], capacity: int, snapshot_store: str | None = None
    ) -> None:
        return None

    async def heartbeat(self, sessions: int, free: int) -> bool:
        return True

    async def mark_down_stale(self, after_seconds: float) -> list[str]:
        return []

    async def leave(self) -> None:
        self.left = True


async def test_stop_ends_a_heartbeat_that_lost_its_cancellation():
    catalog = MarkedDownCatalog()
    returning, swallowed = asyncio.Event(), []

    async def on_return() -> int:
        returning.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallowed:  # the race loses one cancellation, not every one
                raise
            swallowed.append(True)  # lost here, as in wait_for's race: the beat goes on
        return 0

    member = ClusterMembership(
        catalog,  # type: ignore[arg-type]
        host_id="host-a",
        url="http://127.0.0.1:1",
        runtimes=["runc"],
        capacity=1,
        load=lambda: (0, 1),
        interval=0.01,
        down_after=3600.0,
        on_return=on_return,
    )
    await member.start()
    await asyncio.wait_for(returning.wait(), STOP_BOUND_SECONDS)
    heartbeat = member._task
    assert heartbeat is not None
    stopping = asyncio.create_task(member.stop())
    # Waited on, never cancelled: cancelling the stop would reach the heartbeat through it.
    await asyncio.wait({stopping}, timeout=STOP_BOUND_SECONDS)
    try:
        assert stopping.done(), f"the stop had not returned after {STOP_BOUND_SECONDS:g} s"
        assert swallowed, "the first cancellation was not lost: this test did not reproduce the fault"
        assert heartbeat.done()
        assert catalog.left  # and it still said goodbye
    finally:
        for task in (stopping, heartbeat):
            task.cancel()
        await asyncio.gather(stopping, heartbeat, return_exceptions=True)
