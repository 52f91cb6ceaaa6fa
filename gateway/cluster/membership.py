"""This gateway's place in a cluster: registered in the shared catalog, heartbeating, and doing
its share of the housekeeping.

PostgreSQL is the cluster's only coordinator: there is no leader. Every gateway, at each
heartbeat, also marks down the hosts whose heartbeat stopped more than ``host_down_after``
seconds ago (their live sessions become ``lost`` with the reason, in the same transaction, so
two gateways doing it at once change nothing twice). A catalog that cannot be reached never
stops this gateway: its own sessions keep working; what needs the catalog (placing a new
session) is refused at once while :attr:`ClusterMembership.reachable` is false.

Each beat first checks that this gateway still holds its host id in the catalog
(``PostgresStore.check_host_lock``): the lock goes with its connection, so a PostgreSQL restart
or a cut network loses it, and the beat takes it again. If another gateway with the same host
id took it meanwhile, the store refuses every call from then on (it logged why, as an error):
the beats fail, this host stops being ``reachable``, and no session is placed through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from sandkernel.logs import Throttle

log = logging.getLogger(__name__)

# How long one catalog call of the heartbeat may take before it counts as a failed beat: the
# loop must go on beating on time, and a hung connection must not look like a live catalog.
BEAT_TIMEOUT_SECONDS = 5.0
CANCEL_AGAIN_SECONDS = 0.5  # stop(): how long a cancelled heartbeat has to end before it is cancelled again


class HostLock(Protocol):
    """What membership needs of the store under the catalog (gateway/cluster/postgres.py)."""

    async def check_host_lock(self) -> None: ...


class MembershipCatalog(Protocol):
    """What membership needs of gateway/cluster/catalog.py's ClusterCatalog."""

    @property
    def store(self) -> HostLock: ...

    async def register(
        self, url: str, runtimes: Sequence[str], capacity: int, snapshot_store: str | None = None
    ) -> None: ...

    async def heartbeat(self, sessions: int, free: int) -> bool: ...

    async def mark_down_stale(self, after_seconds: float) -> list[str]: ...

    async def leave(self) -> None: ...


class ClusterMembership:
    """Registers this host (its URL, runtimes and capacity) and keeps it up in the catalog.

    ``load`` returns (sessions held, free capacity) at each beat, from the registry."""

    def __init__(
        self,
        catalog: MembershipCatalog,
        *,
        host_id: str,
        url: str,
        runtimes: Sequence[str],
        capacity: int,
        load: Callable[[], tuple[int, int]],
        interval: float,
        down_after: float,
        on_return: Callable[[], Awaitable[int]] | None = None,
        snapshot_store: str | None = None,
    ) -> None:
        self.catalog = catalog
        self.host_id = host_id
        self.url = url
        self.runtimes = tuple(runtimes)
        self.capacity = capacity
        self.load = load
        self.interval = interval
        self.down_after = down_after
        self.snapshot_store = snapshot_store  # hosts with the same one resume each other's paused sessions
        self.on_return = on_return  # after this host was marked down: let go of what was declared lost
        self.last_beat = 0.0  # time.monotonic() of the last beat the catalog took
        # time.monotonic() of the first beat of the current unbroken run of beats (None after a
        # failed one): only a host that has been beating for a whole --host-down-after judges
        # the others by their heartbeats (see beat()).
        self.beating_since: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._failures = Throttle(30.0)

    @property
    def reachable(self) -> bool:
        """The catalog took a beat recently (within two intervals): placing sessions may use it."""
        return time.monotonic() - self.last_beat < 2 * self.interval + BEAT_TIMEOUT_SECONDS

    async def start(self) -> None:
        """Register (a catalog that cannot be reached now fails the start: the operator asked for
        a cluster), then beat in the background."""
        await asyncio.wait_for(
            self.catalog.register(self.url, self.runtimes, self.capacity, self.snapshot_store), BEAT_TIMEOUT_SECONDS
        )
        self.last_beat = self.beating_since = time.monotonic()
        log.info(
            "joined the cluster",
            extra={"host": self.host_id, "url": self.url, "runtimes": list(self.runtimes), "capacity": self.capacity},
        )
        self._task = asyncio.create_task(self._beat_forever(), name="sandkernel-heartbeat")

    async def beat(self) -> list[str]:
        """Check the host id's lock (taken again if it was lost), then one heartbeat and one look
        for hosts gone quiet; returns the hosts marked down now. Raises what the catalog raises
        (HostIdInUseError once another gateway holds this host id).

        The look for quiet hosts waits until this host has beaten without a break for
        ``down_after``: after an outage of the catalog itself every host's last heartbeat is
        old, and the first gateway to get through again would otherwise mark all the others
        down and their live sessions lost, though only the catalog had stopped answering. By
        the time this host has beaten for ``down_after``, every live host has beaten again too."""
        await asyncio.wait_for(self.catalog.store.check_host_lock(), BEAT_TIMEOUT_SECONDS)
        sessions, free = self.load()
        was_down = await asyncio.wait_for(self.catalog.heartbeat(sessions, free), BEAT_TIMEOUT_SECONDS)
        self.last_beat = time.monotonic()
        if self.beating_since is None:
            self.beating_since = self.last_beat
        if was_down and self.on_return is not None:
            lost = await self.on_return()
            log.warning(
                "this host had been marked down: %d session(s) declared lost let go", lost, extra={"host": self.host_id}
            )
        if self.last_beat - self.beating_since < self.down_after:
            return []  # back from a break (or just started): the others get their time to beat again
        down = await asyncio.wait_for(self.catalog.mark_down_stale(self.down_after), BEAT_TIMEOUT_SECONDS)
        for host in down:
            log.warning(
                "host marked down: no heartbeat for %gs; its live sessions are lost",
                self.down_after,
                extra={"host": host},
            )
        return down

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the catalog is away: this host's sessions keep working
                self.beating_since = None
                quiet = self._failures.allow()
                if quiet is not None:
                    log.warning(
                        "cluster heartbeat failed (%d more since the last warning): %s: %s",
                        quiet,
                        type(err).__name__,
                        err,
                        extra={"host": self.host_id},
                    )

    async def stop(self) -> None:
        """Stop beating and say so (status ``stopping``: no new session is placed here while the
        host restarts; its sessions stay, recorded under this host, for the next gateway)."""
        task, self._task = self._task, None
        while task is not None and not task.done():
            # Cancelled again until it ends: a cancellation can be lost inside a beat (Python
            # 3.11's wait_for returns the result when its inner call finishes as the cancel
            # lands), and the loop then sleeps on; awaiting it once hung the stop for good.
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_AGAIN_SECONDS)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.catalog.leave(), BEAT_TIMEOUT_SECONDS)
