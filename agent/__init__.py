"""The agent side: a Python client for the session API (sync and async), and a Claude tool-use
loop that works in a sandbox and leaves its notebook.

A client library must not pull in the server: this package imports only the common base
(``sandkernel.errors``, ``mime``, ``truncation``, ``atomic``, ``output_text``), never the gateway,
the session layer or the recorder (tests/test_import_rules.py). The CLI layer
(``sandkernel.local_gateway``) hands it an in-process gateway when it needs one."""

from sandkernel.agent.client import AsyncSandkernel, AsyncSession
from sandkernel.agent.errors import (
    AuthenticationError,
    BadRequestError,
    ClientError,
    ConflictError,
    GatewayError,
    GatewayUnreachableError,
    LimitExceededError,
    NotFoundError,
    RequestTimeoutError,
    SandboxLostError,
    SessionBusyError,
    SessionPausedError,
    SnapshotFailedError,
    SnapshotQuotaError,
    SnapshotRejectedError,
)
from sandkernel.agent.execution import (
    CodeError,
    Execution,
    ExecutionError,
    ExecutionFailed,
    ExecutionInterruptedError,
    ExecutionRefusedError,
    ExecutionTimeoutError,
    GatewayRestarted,
    Image,
    KernelDiedError,
    KernelRestartedError,
    OutOfMemoryError,
    SessionDeletedError,
)
from sandkernel.agent.sync_client import Sandkernel, Session

__all__ = [
    "AsyncSandkernel",
    "AsyncSession",
    "AuthenticationError",
    "BadRequestError",
    "ClientError",
    "CodeError",
    "ConflictError",
    "Execution",
    "ExecutionError",
    "ExecutionFailed",
    "ExecutionInterruptedError",
    "ExecutionRefusedError",
    "ExecutionTimeoutError",
    "GatewayError",
    "GatewayRestarted",
    "GatewayUnreachableError",
    "Image",
    "KernelDiedError",
    "KernelRestartedError",
    "LimitExceededError",
    "NotFoundError",
    "OutOfMemoryError",
    "RequestTimeoutError",
    "SandboxLostError",
    "Sandkernel",
    "Session",
    "SessionBusyError",
    "SessionDeletedError",
    "SessionPausedError",
    "SnapshotFailedError",
    "SnapshotQuotaError",
    "SnapshotRejectedError",
]
