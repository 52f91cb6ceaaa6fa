"""What the gateway attaches to every session it creates, whichever door will use it.

The session layer emits events (kernels/execution/events.py); here the gateway's own concerns
hear them: the kernel model's ``execution_state`` and idle clock, and the metrics. The
transcript observer comes from notebooks/observer.py. Later: accounting and audit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandkernel.gateway.metrics import GatewayMetrics, MetricsObserver
from sandkernel.kernels.execution.events import ExecutionRequest, SessionObserver
from sandkernel.kernels.execution.outputs import ExecutionResult

if TYPE_CHECKING:
    from sandkernel.gateway.registry import ManagedSession


class ActivityObserver(SessionObserver):
    """Keeps a session's kernel model busy while any door's execution runs, and its idle clock."""

    def __init__(self, managed: ManagedSession) -> None:
        self.managed = managed

    async def execution_started(self, request: ExecutionRequest) -> None:
        self.managed.touch("busy")

    async def execution_finished(self, request: ExecutionRequest, result: ExecutionResult) -> None:
        self.managed.touch("idle")


def observe(managed: ManagedSession, metrics: GatewayMetrics) -> None:
    """Attach the gateway's observers to a newly created (or handed-out) session."""
    managed.session.add_observer(ActivityObserver(managed))
    managed.session.add_observer(MetricsObserver(metrics))
