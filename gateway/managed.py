"""The sessions a gateway holds: live (:class:`ManagedSession`), lost and paused (known by their
catalog record), and the models the APIs render for each.

Below the registry (gateway/registry.py), which indexes them, and below everything that works
on one session (breakers, controls, observers, snapshots, the doors): they all import these
records from here, and this module imports none of them, so no import cycle runs through the
registry. What a session is given from above (its breaker) is named by the small protocol it
needs (:class:`Breaker`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import time
from typing import TYPE_CHECKING, Any, Protocol

from sandkernel.errors import ConfigError, SandboxLostError, SessionPausedError
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.model.records import SandboxRecord, SandboxState
from sandkernel.kernels.sandbox.bulk_io import bulk_io
from sandkernel.kernels.sandbox.exec_stream import FILE_HELPER_TIMEOUT
from sandkernel.kernels.sandbox.workspace_files import WorkspaceFiles
from sandkernel.notebooks.recorder import TranscriptRecorder

if TYPE_CHECKING:
    from sandkernel.gateway.audit.log import AuditLog


class Breaker(Protocol):
    """What a session asks of its circuit breaker (gateway/breakers.py's SessionBreaker)."""

    @property
    def quarantined(self) -> dict[str, Any] | None: ...

    def clear(self) -> None: ...


class PendingWork(Protocol):
    """Work a session's observer started after a cell and that a snapshot must let end first
    (gateway/checkpoints.py's CellCheckpoints: the cell's checkpoint)."""

    async def settled(self) -> None: ...


class TooManySessionsError(ConfigError):
    """A tenant (or the gateway) is at its session limit."""

    status = 429


# What an interrupt answers while a restart is under way (it sends nothing).
RESTART_UNDER_WAY = (
    "a restart of the kernel is under way, so nothing was interrupted: the restart ends the running "
    "cell (status restarted)"
)


def sha256_hex(data: bytes) -> str:
    """The hex SHA-256 of ``data`` (blocking for large data: run it in a thread)."""
    return hashlib.sha256(data).hexdigest()


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def seconds_since(timestamp: str | None) -> float:
    """Seconds between an ISO 8601 timestamp (``now_iso()``'s form) and now; 0 for none or a bad one
    (a clock that went back counts as no time)."""
    if not isinstance(timestamp, str):
        return 0.0
    try:
        then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    if then.tzinfo is None:
        then = then.replace(tzinfo=dt.timezone.utc)
    return max(0.0, (dt.datetime.now(dt.timezone.utc) - then).total_seconds())


@dataclasses.dataclass
class ManagedSession:
    session: KernelSession
    tenant: str
    created: str
    metadata: dict[str, Any]
    kernel_name: str
    last_activity: str = dataclasses.field(default_factory=now_iso)
    execution_state: str = "idle"
    connections: int = 0
    origin: str = "session_api"  # or "kernel_api": who created it decides who may end it
    created_mono: float = dataclasses.field(default_factory=time.monotonic)
    recorder: TranscriptRecorder | None = None  # the session's transcript (an observer of it)
    # execute_replies of websocket executes a previous gateway process left running, for the
    # websockets that (re)connect (settled_replies.py)
    settled_replies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    active_mono: float = dataclasses.field(default_factory=time.monotonic)
    breaker: Breaker | None = None  # its circuit breaker (gateway/controls.py attaches it)
    checkpoints: PendingWork | None = None  # its per-cell checkpoints (--checkpoint-every-cell)
    audit: AuditLog | None = None  # the gateway's audit stream, when it writes one
    helper_timeout: float = FILE_HELPER_TIMEOUT  # the gateway's --helper-timeout (attach_observers)
    # When its --max-lifetime started counting: its creation, or for a fork its parent's (a
    # fork must not renew a lifetime). Kept in the catalog so a later gateway counts the same.
    lifetime_from: str | None = None

    @property
    def files(self) -> WorkspaceFiles:
        """Its /workspace, read and written inside its sandbox within the helper deadline."""
        return WorkspaceFiles(self.session.container, self.helper_timeout)

    @property
    def id(self) -> str:
        return self.session.id

    def audit_record(self, event: str, door: str | None = None, **fields: Any) -> None:
        """Add a record about this session to the audit stream, if there is one."""
        if self.audit is not None:
            self.audit.record(event, tenant=self.tenant, session=self.id, door=door, **fields)

    def touch(self, state: str | None = None) -> None:
        self.last_activity = now_iso()
        self.active_mono = time.monotonic()
        if state:
            self.execution_state = state

    async def interrupt(self, door: str) -> bool:
        """Interrupt the running execution: what the kernel API's and the session API's
        ``/interrupt`` and MCP's ``interrupt`` do (``door`` says which, for the audit). False:
        nothing was sent, a restart is under way (it ends the running cell)."""
        sent = await self.session.interrupt()
        self.audit_record("session_interrupted", door=door, sent=sent)
        return sent

    async def restart(self, door: str) -> None:
        """Restart the kernel (memory state dropped, /workspace kept); the fresh kernel is idle
        whatever was running before: what both the kernel and the session API's ``/restart`` do.
        A restart asked for is also how a caller takes a quarantined session back (its breaker
        is cleared)."""
        await self.session.restart(f"the kernel was restarted on request through the {door} door")
        self.touch("idle")
        if self.breaker is not None:
            self.breaker.clear()
        self.audit_record("session_restarted", door=door)

    async def write_file(self, path: str, data: bytes, door: str) -> dict[str, Any]:
        """Write a tenant's file into /workspace (inside the sandbox), keep a copy in the
        transcript so a replay can restore the session's inputs, and audit it: what every door
        that uploads (the files API, MCP) does."""
        written = await self.files.write(path, data)
        if self.session.meter is not None:  # the upload is not the next cell's doing
            self.session.meter.forget_files()
        # Hashed once, in the tenant's lane of the bulk file threads: tens of MiB hashed on the
        # event loop held every tenant's calls.
        digest = await bulk_io().run(self.tenant, sha256_hex, data)
        if self.recorder is not None:
            self.recorder.record_input(written.get("path", path), data, digest)
        self.audit_record("file_written", door=door, path=written.get("path", path), size=len(data), sha256=digest)
        return written

    def kernel_model(self) -> dict[str, Any]:
        """The Jupyter kernel model (what /api/kernels returns)."""
        return {
            "id": self.session.kernel_id,
            "name": self.kernel_name,
            "last_activity": self.last_activity,
            "execution_state": self.execution_state,
            "connections": self.connections,
        }

    def session_model(self) -> dict[str, Any]:
        """A superset of Jupyter's session model."""
        return {
            "id": self.id,
            "path": str(self.recorder.path) if self.recorder else None,
            "name": self.metadata.get("name", ""),
            "type": "notebook",
            "kernel": self.kernel_model(),
            "created": self.created,
            "profile": self.session.profile.to_dict(public=True),
            "metadata": self.metadata,
            "state": SandboxState.RUNNING.value,
            "quarantined": self.breaker.quarantined if self.breaker is not None else None,
        }

    def gateway_record(self, **extra: Any) -> dict[str, Any]:
        """The registry's part of the session's catalog record: what a later gateway needs to list
        it as this one did (the tenant and the kernel's state are fields of their own)."""
        return {
            "created": self.created,
            "lifetime_from": self.lifetime_from or self.created,
            "metadata": self.metadata,
            "kernel_name": self.kernel_name,
            "origin": self.origin,
            "transcript": str(self.recorder.path) if self.recorder else None,
            "last_activity": self.last_activity,
            "quarantined": self.breaker.quarantined if self.breaker is not None else None,
            **extra,
        }


@dataclasses.dataclass
class RecordedSession:
    """A session the registry knows only by its catalog record (lost or paused): no sandbox runs."""

    record: SandboxRecord

    @property
    def id(self) -> str:
        return self.record.session_id

    @property
    def tenant(self) -> str:
        return self.record.tenant or ""


@dataclasses.dataclass
class LostSession(RecordedSession):
    """A recorded session whose sandbox a restarted gateway could not adopt: it died or was
    removed while no gateway was attached (or, ``refused``, it was not what the record says and
    is left alone for the operator). Listed with its reason until its tenant deletes it; every
    other call on it is a 410 that says so."""

    reason: str
    refused: bool = False

    def error(self) -> SandboxLostError:
        return SandboxLostError(
            f"session {self.id}'s sandbox is lost: {self.reason}. Its variables and files are gone; "
            f"delete it (DELETE /api/sessions/{self.id}) and start a new session"
        )

    def session_model(self) -> dict[str, Any]:
        """The session model of a live session, with state ``lost`` and the reason; its kernel is
        ``dead``."""
        return {
            **recorded_model(self.record, self.record.kernel.get("kernel_id"), "dead"),
            "state": SandboxState.LOST.value,
            "lost_reason": self.reason,
        }


@dataclasses.dataclass
class PausedSession(RecordedSession):
    """A session paused to disk (gateway/snapshots.py): no container, no memory, no CPU; its files
    and the cells that rebuild its memory are kept in a snapshot until it is resumed (explicitly,
    or by its next execute or file call), deleted, or expired after ``paused_ttl``."""

    @property
    def snapshot(self) -> dict[str, Any]:
        """The snapshot's summary (id, bytes, cells, created)."""
        paused = self.record.kernel.get("paused")
        return dict(paused) if isinstance(paused, dict) else {}

    def error(self) -> SessionPausedError:
        return SessionPausedError(
            f"session {self.id} is paused; resume it (POST /api/sessions/{self.id}/resume), or execute code or "
            "use its files: that resumes it"
        )

    def session_model(self) -> dict[str, Any]:
        """The session model with state ``paused`` and its snapshot; its kernel does not run."""
        return {
            **recorded_model(self.record, None, "paused"),
            "state": SandboxState.PAUSED.value,
            "snapshot": self.snapshot,
        }


def recorded_model(record: SandboxRecord, kernel_id: Any, execution_state: str) -> dict[str, Any]:
    """The session model of a session known only by its catalog record (lost, paused)."""
    gateway = record.gateway
    metadata = gateway.get("metadata") if isinstance(gateway.get("metadata"), dict) else {}
    return {
        "id": record.session_id,
        "path": gateway.get("transcript"),
        "name": metadata.get("name", ""),
        "type": "notebook",
        "kernel": {
            "id": kernel_id,
            "name": gateway.get("kernel_name"),
            "last_activity": gateway.get("last_activity"),
            "execution_state": execution_state,
            "connections": 0,
        },
        "created": gateway.get("created"),
        "profile": _public_profile(record.kernel.get("profile")),
        "metadata": metadata,
    }


def record_model(record: SandboxRecord) -> dict[str, Any]:
    """The session model of a session another host holds, from its catalog record (what GET
    /api/sessions lists for it, and, its ``kernel`` part, GET /api/kernels: kernels_api.py; in
    a cluster).
    A live one says ``running``, its kernel ``busy`` while the catalog records an execution in
    flight (the owner writes ``running`` when one starts and clears it when it ends), else
    ``idle``; ``connections`` is the owner's alone (websockets are not recorded): 0."""
    if record.state == SandboxState.LOST:
        return LostSession(record, record.lost_reason or "its host stopped answering").session_model()
    if record.state == SandboxState.PAUSED:
        return PausedSession(record).session_model()
    return {
        **recorded_model(record, record.kernel.get("kernel_id"), "busy" if record.running else "idle"),
        "state": SandboxState.RUNNING.value,
    }


def _public_profile(recorded: Any) -> dict[str, Any]:
    """The public view of a recorded profile ({} when the record's cannot be read back)."""
    from sandkernel.kernels.execution.adoption import profile_from_record

    try:
        return profile_from_record(recorded).to_dict(public=True)
    except Exception:  # a record a newer or older gateway wrote: listing it must still work
        return {}
