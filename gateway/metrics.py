"""Prometheus metrics for the gateway (served at /metrics, without tenant labels).

One registry per gateway instance, so tests and embedded gateways do not share counters.
Executions are counted by an observer attached to every session (:class:`MetricsObserver`), so
every door's executions count: the session API, the Jupyter websocket, the agent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus


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
        self.limit_hits = Counter(
            "sandkernel_limit_hits", "Limits that stopped or cut something", ["limit"], registry=self.registry
        )
        self.kernel_deaths = Counter(
            "sandkernel_kernel_deaths", "Kernels that died (crash or OOM kill)", ["cause"], registry=self.registry
        )

    def record_execution(self, result: ExecutionResult) -> None:
        self.executes.labels(result.status.value).inc()
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
