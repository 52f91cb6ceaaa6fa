"""Circuit breakers: one misbehaving session, or a failing Docker engine, must not drag the
gateway down.

**Per session** (:class:`SessionBreaker`, attached to every session as an observer and a gate).
Code that is OOM-killed or runs into its timeout again and again burns the host's memory and CPU
for nothing (an agent retrying the same bad idea). After ``breaker_ooms`` OOM kills or
``breaker_timeouts`` timeouts *in a row* the session trips:

- ``quarantine`` (the default): every further execute, on every door, is refused before it
  reaches the kernel (status ``refused``, ``refusal.by == "breaker"``) with a message that says
  why and what to do: restart the session (``POST .../restart`` clears the quarantine) or start
  a new one. The sandbox keeps its files; nothing runs until someone decides.
- ``restart``: the kernel is restarted (unless the failure already restarted it, as an OOM kill
  and the timeout ladder's last rungs do) and the count starts again. Nothing is refused.

A result that shows the code ran to its end (``ok``, ``error``, ``interrupted``) resets the
counts; one that says nothing about the code (``refused``, ``detached``) or a crash
(``kernel_died``) leaves them as they are. The quarantine lives in the gateway process: a gateway
restarted under a quarantined session adopts it unquarantined.

**Per gateway** (:class:`StartBreaker`, around every cold sandbox start). When the Docker engine
is down or too slow, each new session request would otherwise wait on it (minutes, holding a
slot of the tenant's and the gateway's limits) and pile up. After ``start_failures`` failures in
a row the breaker *opens*: new starts fail at once with :class:`EngineUnavailableError` (503,
``Retry-After``) for ``start_cooldown`` seconds. Then it is *half open*: the next start is the
probe (a Docker ping in a worker thread, then the start itself); success closes it, failure
opens it again. So it heals by itself once the engine does, without a gateway restart, and
sessions already running (their kernels talk ZMQ, not Docker) are never touched.

What counts as a failure is chosen so a tenant cannot trip the breaker for everyone: a
:class:`DockerUnavailableError` (the engine did not answer) always counts; a start that failed
otherwise (KernelStartError, a timeout) or was slower than ``start_slow_seconds`` counts only if
a Docker ping then fails or is slow too. A tenant may ask for limits that make its own kernel
fail or crawl at start (``start_timeout`` 1 s, ``cpus`` 0.05): with the engine answering
promptly that is the sandbox's business, not the engine's.

Nothing here blocks the event loop: the ping runs in a worker thread, bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sandkernel.errors import DockerUnavailableError, EngineUnavailableError, KernelStartError
from sandkernel.gateway.metrics import GatewayMetrics
from sandkernel.kernels.execution.events import ALLOW, ExecutionRequest, SessionObserver, Verdict
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus, TimeoutStep
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine

if TYPE_CHECKING:
    from sandkernel.gateway.managed import ManagedSession
    from sandkernel.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
T = TypeVar("T")

QUARANTINE = "quarantine"
RESTART = "restart"
# Statuses that show the code ran to an end of its own: the misbehaviour stopped.
RESETS = frozenset({ExecutionStatus.OK, ExecutionStatus.ERROR, ExecutionStatus.INTERRUPTED})
# How an execution ended when the kernel was restarted on the way (nothing left to restart).
RESTARTED_BY_LADDER = frozenset({TimeoutStep.RESTART, TimeoutStep.KILL})

# A Docker ping that takes longer than this (seconds) says the engine is too slow, and is given up.
PING_TIMEOUT = 5.0
# Retry-After while the half-open probe is under way (seconds): it ends within a start.
PROBE_RETRY_SECONDS = 2.0

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class SessionBreaker(SessionObserver):
    """One session's breaker: an observer (it counts results from every door) and an execution
    gate (it refuses while quarantined). Built by the registry for every session it observes;
    ``clear()`` is called when the session is restarted on request."""

    def __init__(self, managed: ManagedSession, settings: GatewaySettings, metrics: GatewayMetrics | None) -> None:
        self.managed = managed
        self.max_ooms = settings.breaker_ooms
        self.max_timeouts = settings.breaker_timeouts
        self.action = settings.breaker_action
        self.metrics = metrics
        self.ooms = 0
        self.timeouts = 0
        self._quarantined: dict[str, Any] | None = None

    @property
    def quarantined(self) -> dict[str, Any] | None:
        """``{"reason", "since", "ooms", "timeouts"}`` while executes are refused, else None
        (what the session model shows)."""
        return dict(self._quarantined) if self._quarantined is not None else None

    def clear(self) -> None:
        """Lift the quarantine and start counting again (the session was restarted on request:
        its kernel is fresh, and whoever restarted it has seen why)."""
        if self._quarantined is not None:
            log.info("session quarantine lifted", extra={"session": self.managed.id})
        self._quarantined = None
        self.ooms = self.timeouts = 0

    def restore(self, recorded: Any) -> None:
        """Quarantine again a session the previous gateway process had quarantined (its catalog
        record's ``quarantined``, written by this gateway: still checked for shape)."""
        if not isinstance(recorded, dict) or not isinstance(recorded.get("reason"), str):
            return
        self._quarantined = {
            "reason": recorded["reason"][:500],
            "since": str(recorded.get("since", ""))[:64],
            "ooms": recorded.get("ooms") if isinstance(recorded.get("ooms"), int) else 0,
            "timeouts": recorded.get("timeouts") if isinstance(recorded.get("timeouts"), int) else 0,
        }
        log.warning("session quarantine restored from the catalog", extra={"session": self.managed.id})

    async def admit(self, request: ExecutionRequest) -> Verdict:
        """Refuse every execution while quarantined (ExecutionGate)."""
        if self._quarantined is None:
            return ALLOW
        session = self.managed.id
        message = (
            f"this session is quarantined: {self._quarantined['reason']} (since {self._quarantined['since']}), "
            f"so the gateway refuses to run more code in it. The code did not run. Change the approach "
            f"(less memory, less work per cell), then restart the session (POST /api/sessions/{session}/restart "
            "clears the quarantine; variables are lost, /workspace files are kept) or start a new session."
        )
        return Verdict(refusal={"by": "breaker", "rule": QUARANTINE, "message": message})

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        status = result.status
        if status in RESETS:
            self.ooms = self.timeouts = 0
            return
        if status is ExecutionStatus.OOM:
            self.ooms += 1
            if self.max_ooms and self.ooms >= self.max_ooms:
                await self._trip("oom", f"its code was OOM-killed {self.ooms} times in a row", result)
        elif status is ExecutionStatus.TIMEOUT:
            self.timeouts += 1
            if self.max_timeouts and self.timeouts >= self.max_timeouts:
                await self._trip("timeout", f"its code ran into its timeout {self.timeouts} times in a row", result)

    async def _restart(self, reason: str, already: bool) -> None:
        """The breaker's restart, once the execution that tripped it is recorded (unless that
        execution's end already restarted the kernel: an OOM kill, the timeout ladder)."""
        session = self.managed.session
        if not already:
            await session.restart(f"the kernel was restarted by the gateway's circuit breaker: {reason}")
        await session.note(
            f"The gateway's circuit breaker tripped: {reason}. "
            + ("The kernel was restarted; variables are gone, /workspace files are kept." if not already else "")
        )

    async def _trip(self, kind: str, reason: str, result: ExecutionResult) -> None:
        if self._quarantined is not None:
            return
        if self.metrics is not None:
            self.metrics.breaker_trips.labels(kind).inc()
        if self.action == RESTART:
            log.warning(
                "session breaker tripped (%s): restarting the kernel", reason, extra={"session": self.managed.id}
            )
            self.ooms = self.timeouts = 0
            # Queued, not awaited here: every observer hears this result before the restart's events.
            self.managed.session.after_execution(lambda: self._restart(reason, status_restarted_kernel(result)))
            return
        self._quarantined = {
            "reason": reason,
            "since": _now_iso(),
            "ooms": self.ooms,
            "timeouts": self.timeouts,
        }
        log.warning("session quarantined: %s", reason, extra={"session": self.managed.id})
        await self.managed.session.note(
            f"Session quarantined by the gateway's circuit breaker: {reason}. Executes are refused until "
            "the session is restarted."
        )


def status_restarted_kernel(result: ExecutionResult) -> bool:
    """Whether the kernel was already restarted by the time ``result`` came back (an OOM kill
    or crash is followed by a restart; so are the timeout ladder's last rungs)."""
    if result.status in (ExecutionStatus.OOM, ExecutionStatus.KERNEL_DIED):
        return True
    return result.ended_by in RESTARTED_BY_LADDER


class StartBreaker:
    """The gateway's breaker around cold sandbox starts (see the module docstring).

    ``engine`` is the Docker engine pinged to tell an engine failure from a sandbox's own
    (default: the process's). ``clock`` is a monotonic clock in seconds."""

    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics | None = None,
        engine: DockerEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = settings.start_failures
        self.slow_seconds = settings.start_slow_seconds
        self.cooldown = settings.start_cooldown
        self.metrics = metrics
        self._engine = engine
        self._clock = clock
        self.consecutive_failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self._in_flight: dict[int, float] = {}  # id of a running start -> when it began
        self.last_failure: str | None = None
        if metrics is not None:
            metrics.watch_start_breaker(self.health, STATES)

    @property
    def engine(self) -> DockerEngine:
        return self._engine if self._engine is not None else default_engine()

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        if self._probing or self._clock() - self._opened_at >= self.cooldown:
            return HALF_OPEN
        return OPEN

    def retry_after(self) -> float:
        """Seconds until a new start may be tried (0 when one may now)."""
        if self._opened_at is None:
            return 0.0
        if self._probing:
            return PROBE_RETRY_SECONDS
        return max(0.0, self.cooldown - (self._clock() - self._opened_at))

    def health(self) -> dict[str, Any]:
        """What /api/health shows: ``state`` (closed / open / half_open), ``consecutive_failures``
        and ``retry_after`` (whole seconds until new sessions are tried again; 0 when closed)."""
        health: dict[str, Any] = {
            "state": self.state if self.enabled else CLOSED,
            "consecutive_failures": self.consecutive_failures,
            "retry_after": math.ceil(self.retry_after()),
        }
        if self.state != CLOSED and self.last_failure:
            health["last_failure"] = self.last_failure
        return health

    async def guard(self, start: Callable[[], Awaitable[T]]) -> T:
        """Run ``start`` (a cold sandbox start) unless the breaker is open; count its outcome.

        Raises :class:`EngineUnavailableError` at once while open (and while another request
        probes the half-open breaker); otherwise whatever ``start`` raises, after counting it."""
        if not self.enabled:
            return await start()
        state = self.state
        if state == OPEN or (state == HALF_OPEN and self._probing):
            raise self._refusal()
        if state == CLOSED and await self._piling_up():
            self._open(
                "starts are piling up: sandbox starts have been running for over "
                f"{self.slow_seconds:g}s and the Docker engine is slow or down"
            )
            raise self._refusal()
        probe = state == HALF_OPEN
        if probe:
            self._probing = True
            try:
                failure = await self._ping_failure()
            except BaseException:
                self._probing = False
                raise
            if failure is not None:
                self._probing = False
                self._open(f"the Docker engine still does not answer ({failure})")
                raise self._refusal()
        token = object()
        began = self._clock()
        self._in_flight[id(token)] = began
        try:
            value = await start()
        except asyncio.CancelledError:
            if probe:  # the probe's caller went away: the next request probes again at once
                self._probing = False
            raise
        except BaseException as err:
            if probe:
                self._probing = False
            await self._failed(err, self._clock() - began, probe)
            raise
        finally:
            self._in_flight.pop(id(token), None)
        if probe:
            self._probing = False
        await self._succeeded(self._clock() - began, probe)
        return value

    # -- outcomes ---------------------------------------------------------------------------

    async def _succeeded(self, seconds: float, probe: bool) -> None:
        if seconds > self.slow_seconds:
            failure = await self._ping_failure()
            if failure is not None:
                self._count(f"a sandbox start took {seconds:.1f}s and {failure}", probe)
                return
            log.info("a sandbox start took %.1fs with the Docker engine answering promptly: not counted", seconds)
        self._close()

    async def _failed(self, err: BaseException, seconds: float, probe: bool) -> None:
        if isinstance(err, DockerUnavailableError):
            self._count(str(err), probe)
            return
        if isinstance(err, (KernelStartError, TimeoutError)) or seconds > self.slow_seconds:
            failure = await self._ping_failure()
            if failure is not None:
                self._count(f"{err} ({failure})", probe)
                return
            log.info("a sandbox start failed with the Docker engine answering (not counted): %s", err)
        if probe:  # the engine answers promptly: the failure was this sandbox's own
            self._close()

    def _close(self) -> None:
        if self._opened_at is not None:
            log.warning("start breaker closed: sandboxes start again")
        self.consecutive_failures = 0
        self._opened_at = None
        self.last_failure = None

    def _count(self, why: str, probe: bool) -> None:
        self.consecutive_failures += 1
        self.last_failure = why
        if self.metrics is not None:
            self.metrics.start_failures.inc()
        if probe or self.consecutive_failures >= self.threshold:
            self._open(why)

    def _open(self, why: str) -> None:
        first = self._opened_at is None
        self._opened_at = self._clock()
        self.last_failure = why
        if first:
            if self.metrics is not None:
                self.metrics.breaker_trips.labels("start").inc()
            log.error(
                "start breaker open: new sessions are refused for %gs (%d failures in a row: %s)",
                self.cooldown,
                self.consecutive_failures,
                why,
            )

    def _refusal(self) -> EngineUnavailableError:
        if self.metrics is not None:
            self.metrics.starts_refused.inc()
        wait = max(1.0, self.retry_after())
        return EngineUnavailableError(
            f"new sessions are refused for now: sandbox starts keep failing or are too slow "
            f"({self.last_failure or 'the Docker engine is unavailable'}). Existing sessions keep working. "
            f"Retry in {math.ceil(wait)}s.",
            retry_after=wait,
        )

    async def _piling_up(self) -> bool:
        """Whether starts now under way have been running longer than ``start_slow_seconds``, so
        many that with the failures already counted they reach the threshold, and the engine is
        slow to answer a ping: then this request would only join the queue."""
        now = self._clock()
        stuck = sum(1 for began in self._in_flight.values() if now - began > self.slow_seconds)
        if stuck == 0 or self.consecutive_failures + stuck < self.threshold:
            return False
        return await self._ping_failure() is not None

    async def _ping_failure(self) -> str | None:
        """None when the Docker engine answers a ping within :data:`PING_TIMEOUT`, else what
        went wrong. The ping runs in a worker thread (the SDK blocks); a hung one is left to
        finish there, the event loop is never held."""
        engine = self.engine
        began = self._clock()
        try:
            await asyncio.wait_for(engine.run(lambda: engine.client.ping()), PING_TIMEOUT)
        except TimeoutError:
            return f"the Docker engine did not answer a ping within {PING_TIMEOUT:g}s"
        except DockerUnavailableError as err:
            return f"the Docker engine does not answer: {err}"
        except Exception as err:  # an API error from a sick engine
            return f"the Docker engine's ping failed: {err}"
        took = self._clock() - began
        if took > PING_TIMEOUT:
            return f"the Docker engine took {took:.1f}s to answer a ping"
        return None
