"""What the session catalog holds about one sandbox: a :class:`SandboxRecord`.

A record is everything a later gateway process needs to find a sandbox again and to answer
for it: the kernel's own durable state (opaque here; it holds the kernel's HMAC key, which is
why the catalog file is 0600), the gateway's registry entry, the execution that was in flight,
and whether the sandbox is still there. The store (``store.py``) keeps records; it never looks
inside ``kernel``, ``gateway`` or ``running`` beyond storing them as JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any


class SandboxKind(enum.StrEnum):
    """Who a sandbox belongs to: a live session, or the warm pool (never used yet)."""

    SESSION = "session"
    POOL = "pool"


class SandboxState(enum.StrEnum):
    """``running``: the sandbox was alive when last seen. ``lost``: it died or was removed while
    no gateway was attached (``lost_reason`` says how); kept so a GET can say so. ``paused``: it
    has no sandbox; a snapshot (kernels/snapshots/) holds its files, ``kernel["paused"]`` names it."""

    RUNNING = "running"
    LOST = "lost"
    PAUSED = "paused"


# The fields ``SessionStore.update`` may change (the rest identify a record or are set by the store).
UPDATABLE_FIELDS = frozenset({"state", "tenant", "gateway", "running", "lost_reason", "kernel"})


@dataclasses.dataclass
class SandboxRecord:
    """One catalogued sandbox. ``kind`` and ``state`` accept their strings and are parsed into
    :class:`SandboxKind` / :class:`SandboxState` here, once (an unknown value raises ValueError)."""

    session_id: str
    kind: str  # SandboxKind: "session" | "pool"
    kernel: dict[str, Any]  # KernelSession.durable_state(): JSON, opaque to the store; holds the HMAC key
    state: str = SandboxState.RUNNING  # SandboxState: "running" | "lost" | "paused"
    tenant: str | None = None
    gateway: dict[str, Any] = dataclasses.field(default_factory=dict)  # the registry's own JSON
    running: dict[str, Any] | None = None  # the execution in flight (request fields + started_at), or None
    lost_reason: str | None = None
    created_at: float = dataclasses.field(default_factory=time.time)  # seconds since the epoch
    updated_at: float = dataclasses.field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not self.session_id:
            raise ValueError(f"a sandbox record needs a session id, not {self.session_id!r}")
        self.kind = SandboxKind(self.kind)
        self.state = SandboxState(self.state)
