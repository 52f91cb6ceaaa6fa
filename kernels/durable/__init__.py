"""Durable sessions: what lets a sandbox outlive the gateway process that started it.

``store``: the session catalog that keeps records (kernels/model/records.py) in a file under
the state dir (:func:`open_store`, the :class:`SessionStore` interface, :class:`StoreError`,
:data:`SCHEMA_VERSION` and migrations). Reconnecting a later process to the recorded sandboxes is
kernels/execution/adoption.py. The same interface on PostgreSQL, shared by the gateways of a
cluster, lives beside the cluster catalog (gateway/cluster/postgres.py, with ``pg_schema``,
``pg_host_lock`` and ``pg_errors``); psycopg (the ``cluster`` extra) is needed only to open it.
"""

from sandkernel.kernels.durable.store import SCHEMA_VERSION, SessionStore, StoreError, open_store
from sandkernel.kernels.model.records import SandboxKind, SandboxRecord, SandboxState

__all__ = ["SCHEMA_VERSION", "SandboxKind", "SandboxRecord", "SandboxState", "SessionStore", "StoreError", "open_store"]
