"""What every session the gateway holds carries: the one place its observers and gates are
registered, and in which order.

A session's events (kernels/execution/events.py) are heard by its observers in the order they
were added, and its gates are asked in theirs; both orders matter, so they are declared here
and nowhere else (a test keeps ``add_observer`` / ``add_gate`` out of every other gateway module):

observers, for every session the registry takes on (created, handed out of the pool, adopted,
resumed, forked, rewound):

1. the transcript (notebooks/observer.py): first, so every later observer's note lands after
   the cell it is about; attached when the recorder starts (:meth:`SessionWiring.transcript`),
   before the session is recorded in the catalog;
2. the circuit breaker (gateway/breakers.py): before the catalog records a result, so a
   quarantine is in the record that says how the cell ended; a restart it decides is queued
   after the execution (the session runs it once every observer has heard the result);
3. the audit observer (gateway/audit/observer.py);
4. activity: the kernel model's ``execution_state`` and idle clock (gateway/session_observers.py);
5. metrics;
6. the catalog writer (so a later gateway process can adopt the session);
7. per-cell checkpoints (gateway/checkpoints.py), with ``--checkpoint-every-cell``: last, it
   starts an archive after everything else heard the cell.

gates, asked in order before any code reaches the kernel: the audit gate (the cheapest: a
tenant the audit log cannot keep up with costs no policy review), the execution policy (a
refused cell never counts toward the breaker), the breaker's quarantine, a pending checkpoint.

Two short-lived registrations live here too: the gates and audit a replayed cell passes before
the registry takes the sandbox on (:meth:`SessionWiring.on_replay`), and the observer that
answers a websocket execute a previous gateway process left running (:meth:`settle`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from sandkernel.gateway.audit.gate import AuditGate
from sandkernel.gateway.audit.observer import AuditObserver
from sandkernel.gateway.breakers import SessionBreaker
from sandkernel.gateway.checkpoints import CellCheckpoints
from sandkernel.gateway.controls import SessionControls
from sandkernel.gateway.managed import ManagedSession
from sandkernel.gateway.metrics import GatewayMetrics, MetricsObserver
from sandkernel.gateway.session_observers import ActivityObserver, CatalogObserver, CatalogWriter
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.gateway.settled_replies import SettledReplies, Websockets
from sandkernel.kernels.execution.events import ExecutionGate, SessionObserver
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.policy import PolicyGate
from sandkernel.notebooks.observer import attach_transcript
from sandkernel.notebooks.recorder import TranscriptRecorder

Checkpoint = Callable[[ManagedSession], Awaitable[Any]]


class SessionWiring:
    """Registers the gateway's observers and gates on a session (see the module docstring).

    ``checkpoint`` is the snapshot manager's ``checkpoint`` (gateway/snapshots.py; used with
    ``--checkpoint-every-cell``; None: a gateway without snapshots)."""

    def __init__(
        self,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        controls: SessionControls | None,
        writer: CatalogWriter | None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.controls = controls
        self.writer = writer
        self.checkpoint = checkpoint

    async def transcript(self, session: KernelSession, recorder: TranscriptRecorder) -> None:
        """Start recording ``session`` (observer 1): before the registry takes it on."""
        await attach_transcript(session, recorder)

    def attach(self, managed: ManagedSession) -> None:
        """Put the gateway's gates and observers 2-7 on a session the registry takes on."""
        managed.helper_timeout = self.settings.helper_timeout
        session = managed.session
        controls = self.controls
        breaker = SessionBreaker(managed, self.settings, self.metrics) if controls is not None else None
        managed.breaker = breaker
        checkpoints = (
            CellCheckpoints(self.checkpoint, managed)
            if self.checkpoint is not None and self.settings.checkpoint_every_cell
            else None
        )
        managed.checkpoints = checkpoints
        gates: list[ExecutionGate | None] = [*self._control_gates(managed.tenant), breaker, checkpoints]
        observers: list[SessionObserver | None] = [
            breaker,
            self._audit_observer(managed.tenant, managed.id),
            ActivityObserver(managed),
            MetricsObserver(self.metrics),
            CatalogObserver(managed, self.writer) if self.writer is not None else None,
            checkpoints,
        ]
        if controls is not None:
            session.set_accounting(controls.settings.accounting)
            managed.audit = controls.audit
        for gate in gates:
            if gate is not None:
                session.add_gate(gate)
        for observer in observers:
            if observer is not None:
                session.add_observer(observer)

    def _control_gates(self, tenant: str) -> list[ExecutionGate]:
        """The operator's gates new code passes: the audit gate first, then the policy."""
        controls = self.controls
        if controls is None:
            return []
        gates: list[ExecutionGate] = []
        if controls.audit is not None:
            gates.append(AuditGate(controls.audit, tenant))
        if controls.policy is not None:
            gates.append(PolicyGate(controls.policy))
        return gates

    def _audit_observer(self, tenant: str, session_id: str) -> AuditObserver | None:
        audit = self.controls.audit if self.controls is not None else None
        return AuditObserver(tenant, session_id, audit) if audit is not None else None

    @contextlib.contextmanager
    def on_replay(self, session: KernelSession, tenant: str) -> Iterator[None]:
        """The gates and audit new code passes, on the cells a sandbox replays before the
        registry takes it on (resume, rewind, fork): the operator's policy as it is now (it may
        have been tightened since the cells first ran), the audit gate, and an audit record per
        replayed cell (``door`` replay). Taken off at the end; :meth:`attach` puts on its own."""
        gates = self._control_gates(tenant)
        observer = self._audit_observer(tenant, session.id)
        for gate in gates:
            session.add_gate(gate)
        if observer is not None:
            session.add_observer(observer)
        try:
            yield
        finally:
            for gate in gates:
                session.remove_gate(gate)
            if observer is not None:
                session.remove_observer(observer)

    def settle(self, managed: ManagedSession, websockets: Websockets, msg_id: str) -> None:
        """Answer, once it ends, the websocket execute ``msg_id`` a previous gateway process left
        running (gateway/settled_replies.py): the observer takes itself off after it."""
        managed.session.add_observer(SettledReplies(managed, websockets, msg_id))
