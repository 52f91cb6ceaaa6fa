"""Durable sessions: what lets a sandbox outlive the gateway process that started it.

``records``: what is kept about one sandbox (:class:`SandboxRecord`); ``store``: the session
catalog that keeps records in a file under the state dir (:func:`open_store`, the
:class:`SessionStore` interface, :class:`StoreError`, :data:`SCHEMA_VERSION` and migrations);
``adoption``: reconnecting a later process to the recorded sandboxes. ``postgres``: the same
interface on PostgreSQL, shared by the gateways of a cluster (its schema in ``pg_schema``, the
one-gateway-per-host-id lock in ``pg_host_lock``, its address and errors in ``pg_errors``);
psycopg (the ``cluster`` extra) is needed only to open it.
"""

from sandkernel.kernels.durable.store import SCHEMA_VERSION, SessionStore, StoreError, open_store
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord, SandboxState

__all__ = ["SCHEMA_VERSION", "SandboxKind", "SandboxRecord", "SandboxState", "SessionStore", "StoreError", "open_store"]
