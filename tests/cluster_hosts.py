"""Gateways of one test cluster, started together and stopped cleanly: the fixture several
cluster test modules share (two or more real ``sandkernel serve`` processes on this engine, one
catalog database on a real PostgreSQL, one cluster secret).

The host class is the caller's (tests/test_forwarding.py's ``Host``: a ``Serve`` with the
cluster's flags): this module only needs what :class:`ClusterHost` names, so the module that
defines the class can use it too without an import cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from .postgres_fixtures import create_database, drop_database


class ClusterHost(Protocol):
    """What the fixture needs of a host: its flags (extended before it starts), a start, and the
    ``Serve`` process under it (tests/test_durable_sessions.py)."""

    flags: tuple[str, ...]
    serve: Any

    async def start(self) -> Any: ...


H = TypeVar("H", bound=ClusterHost)


@dataclass
class Cluster(Generic[H]):
    """The running hosts, in the order named, and their catalog database's URL."""

    hosts: list[H]
    catalog_url: str


async def stop_hosts(hosts: Iterable[ClusterHost]) -> None:
    """SIGTERM each host's gateway that still runs, in order; each must exit 0 (its output's
    tail is the failure message otherwise). A host never started, or already stopped, is passed."""
    for host in hosts:
        if host.serve.proc is not None and host.serve.proc.poll() is None:
            assert await host.serve.term() == 0, host.serve.output[-4000:]


@contextlib.asynccontextmanager
async def running_cluster(
    make_host: Callable[[Path, str, str, Path], H],
    root: Path,
    server_url: str,
    secret: bytes,
    names: Sequence[str] = ("host-a", "host-b"),
    flags: Mapping[str, Sequence[str]] | None = None,
) -> AsyncIterator[Cluster[H]]:
    """One host per name (``make_host(root, name, catalog_url, secret_file)``) on a fresh
    database of the PostgreSQL at ``server_url``, with the secret in ``root/cluster.secret``
    (0600) and each host's extra ``flags``; all started together. On the way out each is
    stopped (:func:`stop_hosts`) and the database dropped, whatever the test did."""
    catalog_url = create_database(server_url)
    secret_file = root / "cluster.secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    hosts = [make_host(root, name, catalog_url, secret_file) for name in names]
    for host, name in zip(hosts, names, strict=True):
        host.flags += tuple((flags or {}).get(name, ()))
    try:
        await asyncio.gather(*(host.start() for host in hosts))
        yield Cluster(hosts, catalog_url)
    finally:
        try:
            await stop_hosts(hosts)
        finally:
            drop_database(catalog_url)
