"""Prometheus metrics for the gateway (served at /metrics, without tenant labels).

One registry per gateway instance, so tests and embedded gateways do not share counters.
Executions are counted by an observer attached to every session (:class:`MetricsObserver`), so
every door's executions count: the session API, the Jupyter websocket, the agent. The same
observer counts what the results carry since issue 15: policy findings, refusals (by the policy
or a session's breaker) and the CPU seconds cells used (accounting). The circuit breakers
(breakers.py) count their trips here, and the start breaker's state is read at each scrape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus

# A label value longer than this is cut (a custom policy check names its own rules).
MAX_LABEL_CHARS = 64
# Seconds between two walks of the snapshot store for sandkernel_snapshot_bytes: scrapes in
# between answer from the last walk, so scraping often costs the disk and the workers nothing.
SNAPSHOT_BYTES_INTERVAL = 30.0


class ThrottledReading:
    """A gauge set from a blocking reading (a disk walk) at most once per ``interval`` seconds;
    concurrent scrapes wait for the one walk under way instead of starting their own."""

    def __init__(self, gauge: Gauge, interval: float) -> None:
        self.gauge = gauge
        self.interval = interval
        self._read_at: float | None = None
        self._lock = asyncio.Lock()

    async def refresh(self, read: Callable[[], float]) -> None:
        async with self._lock:
            if self._read_at is not None and time.monotonic() - self._read_at < self.interval:
                return
            self.gauge.set(await asyncio.to_thread(read))
            self._read_at = time.monotonic()


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sessions = Gauge("sandkernel_sessions", "Live sessions (sandboxed kernels)", registry=self.registry)
        self.executes = Counter(
            "sandkernel_executes",
            "Executions by any door, by final status",
            ["status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "sandkernel_execute_duration_seconds",
            "Wall time of executions, by any door",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.forwarded = Counter(
            "sandkernel_forwarded_requests",
            "HTTP requests passed to the host that holds their session (cluster), by the way they took: "
            "fast_lane (relayed before tornado reads them) or handler (tornado's request handler)",
            ["way"],
            registry=self.registry,
        )
        self.limit_hits = Counter(
            "sandkernel_limit_hits", "Limits that stopped or cut something", ["limit"], registry=self.registry
        )
        self.kernel_deaths = Counter(
            "sandkernel_kernel_deaths", "Kernels that died (crash or OOM kill)", ["cause"], registry=self.registry
        )
        self.snapshot_ops = Counter(
            "sandkernel_snapshot_operations",
            "Snapshot operations that succeeded: pause, resume, fork (one per fork made), rewind",
            ["operation"],
            registry=self.registry,
        )
        self.paused_sessions = Gauge(
            "sandkernel_sessions_paused", "Sessions paused to disk; set at each scrape", registry=self.registry
        )
        self.snapshot_bytes = Gauge(
            "sandkernel_snapshot_bytes",
            f"Disk used by snapshots, all tenants; read at a scrape at most every {SNAPSHOT_BYTES_INTERVAL:g} s",
            registry=self.registry,
        )
        self.snapshot_bytes_reading = ThrottledReading(self.snapshot_bytes, SNAPSHOT_BYTES_INTERVAL)
        self.quarantined = Gauge(
            "sandkernel_sessions_quarantined",
            "Live sessions whose breaker refuses executes (repeated OOM kills or timeouts); set at each scrape",
            registry=self.registry,
        )
        self.breaker_trips = Counter(
            "sandkernel_breaker_trips",
            "Circuit breakers that tripped: a session's (oom, timeout) or the gateway's start breaker (start)",
            ["kind"],
            registry=self.registry,
        )
        self.start_breaker_state = Gauge(
            "sandkernel_start_breaker_state",
            "The start breaker's state: 1 for the current one (closed, open, half_open)",
            ["state"],
            registry=self.registry,
        )
        self.start_failures = Counter(
            "sandkernel_sandbox_start_failures",
            "Sandbox starts that failed or were too slow because of the Docker engine",
            registry=self.registry,
        )
        self.starts_refused = Counter(
            "sandkernel_sandbox_starts_refused",
            "New sessions refused at once (503) because the start breaker was open",
            registry=self.registry,
        )
        self.policy_findings = Counter(
            "sandkernel_policy_findings",
            "Execution policy findings, by rule and action (warn, deny)",
            ["rule", "action"],
            registry=self.registry,
        )
        self.refused = Counter(
            "sandkernel_refused_executions",
            "Executions refused before they ran, by who refused them (policy, breaker, audit)",
            ["by"],
            registry=self.registry,
        )
        self.cpu_seconds = Counter(
            "sandkernel_cell_cpu_seconds",
            "CPU seconds (user + system) cells used in their sandboxes, as accounting measured them",
            registry=self.registry,
        )

    def watch_start_breaker(self, health: Callable[[], dict[str, Any]], states: Iterable[str]) -> None:
        """Read the start breaker's state from ``health`` (its ``health()``) at every scrape (it
        changes with time: open -> half_open), one gauge per state of ``states``. Given the
        method, not the breaker: the breakers report to these metrics, so this module names none
        of theirs."""
        for state in states:
            self.start_breaker_state.labels(state).set_function(
                lambda state=state: 1.0 if health()["state"] == state else 0.0
            )

    def record_execution(self, result: ExecutionResult) -> None:
        self.executes.labels(result.status.value).inc()
        for finding in result.policy:
            rule = str(finding.get("rule", ""))[:MAX_LABEL_CHARS]
            self.policy_findings.labels(rule, str(finding.get("action", ""))[:MAX_LABEL_CHARS]).inc()
        if result.status is ExecutionStatus.REFUSED:
            by = (result.refusal or {}).get("by", "")
            self.refused.labels(str(by)[:MAX_LABEL_CHARS]).inc()
            return  # nothing ran: no duration, no cost
        cpu = (result.accounting or {}).get("cpu_seconds")
        if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and cpu > 0:
            self.cpu_seconds.inc(cpu)
        self.duration.observe(result.duration)
        if result.status is ExecutionStatus.TIMEOUT:
            self.limit_hits.labels("timeout").inc()
        if result.status is ExecutionStatus.OOM:
            self.limit_hits.labels("memory").inc()
            self.kernel_deaths.labels("oom").inc()
        if result.status is ExecutionStatus.KERNEL_DIED:
            self.kernel_deaths.labels("crash").inc()

    def record_reply_truncated(self) -> None:
        """A reply was cut to its output budget (counted by the door that applies the budget)."""
        self.limit_hits.labels("output_budget").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsObserver(SessionObserver):
    """Counts one session's executions, whichever door they came through."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        self.metrics.record_execution(result)
