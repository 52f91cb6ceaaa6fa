"""Find and remove sandkernel containers whose owning process is gone.

Every container carries ``sandkernel.owner=<host>:<pid>:<start-time>``. A process that
crashed (or was SIGKILLed) cannot clean up after itself, so whoever starts next (the
gateway at start-up, ``sandkernel reap``, the test suite) removes containers whose owner
is no longer alive, together with their host runtime dirs.

Durable sessions (issue 13) outlive their owner on purpose: a gateway that stopped leaves its
sandboxes running for the next one, which finds them in the session catalog. So whoever reaps
passes ``keep``, the session ids the catalog records (:func:`catalogued_session_ids`), and
those containers are never removed, whatever their owner label says. A catalog that cannot be
read stops the reaping altogether (StoreError): removing durable sandboxes because their
record could not be read would destroy tenants' work.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import docker.errors

from sandkernel.errors import SandkernelError
from sandkernel.kernels.durable.store import CATALOG_NAME, read_session_ids
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.labels import (
    OWNER_LABEL,
    RUNTIME_DIR_LABEL,
    SESSION_LABEL,
    own_runtime_dir,
    owner_alive,
)
from sandkernel.kernels.sandbox.runtime_dir import remove_runtime_dir
from sandkernel.kernels.sandbox.state_dir import STATE_DIR_LABEL
from sandkernel.kernels.sandbox.workspace_disk import remove_workspace_disk, sweep_workspace_disks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReapReport:
    removed: tuple[str, ...]
    kept: int


def catalogued_session_ids(path: str | os.PathLike[str] | None = None) -> set[str]:
    """The session ids the session catalog records (default: the state dir's catalog), which a
    reaper must keep (blocking: the CLI, or a worker thread). No catalog file: none. A damaged
    catalog or one from a newer sandkernel raises StoreError: do not reap then."""
    return read_session_ids(path)


def reap_sync(
    engine: DockerEngine | None = None,
    *,
    owner: str | None = None,
    everything: bool = False,
    keep: Collection[str] = (),
    sessions: Collection[str] = (),
    authoritative: Path | None = None,
) -> ReapReport:
    """Remove orphaned sandkernel containers (blocking; call from a thread or the CLI).

    ``owner``: remove exactly the containers of that owner (a test suite cleaning up after
    itself). ``everything``: remove all sandkernel containers. Default: those whose owner died.
    ``keep``: session ids never removed, whichever of these applies (the catalogued ones).
    ``sessions``: session ids whose containers are removed whoever owns them (paused sessions
    have none: one left by a crash mid-resume would otherwise run unmanaged).
    ``authoritative``: the caller's own state dir, whose sessions ``keep`` already lists in full
    (a gateway at start-up, from its catalog, SQLite or PostgreSQL): its containers are judged by
    ``keep`` alone, not by reading the state dir's catalog again.
    """
    keep = frozenset(keep)
    sessions = frozenset(sessions)
    engine = engine or default_engine()
    removed: list[str] = []
    kept = 0
    recorded = RecordedElsewhere(authoritative)
    containers = listed_containers(engine)
    for container in containers:
        labels = container.labels
        label = labels.get(OWNER_LABEL, "")
        if labels.get(SESSION_LABEL) in keep:
            kept += 1
        elif (
            everything
            or labels.get(SESSION_LABEL) in sessions
            or (owner is not None and label == owner)
            or (owner is None and not owner_alive(label) and not recorded(labels))
        ):
            log.info("reaping container", extra={"container": container.name, "owner": label})
            try:
                engine.client.api.remove_container(container.id, force=True)
            except docker.errors.APIError as err:  # already gone, or being removed by its owner
                log.debug("reap: %s: %s", container.name, err)
            rundir = own_runtime_dir(labels.get(RUNTIME_DIR_LABEL, ""))
            if rundir is not None:
                remove_runtime_dir(rundir)  # and its -egress sibling (an allowlist session's proxy socket)
            _remove_disk(labels.get(SESSION_LABEL, ""), container.name)
            removed.append(container.name)
        else:
            kept += 1
    if owner is None:  # disks whose container is gone for good (a crash between the two)
        held = keep | {c.labels.get(SESSION_LABEL, "") for c in containers if c.name not in removed}
        try:
            sweep_workspace_disks(held | catalogued_session_ids(), owner_alive)
        except (SandkernelError, OSError) as err:
            log.warning("reap: workspace disks not swept: %s", err)
    return ReapReport(tuple(removed), kept)


@dataclass(frozen=True)
class ListedContainer:
    """What one sparse listing says of a container: all the reaper decides on."""

    id: str
    name: str
    labels: dict[str, str]


def listed_containers(engine: DockerEngine) -> list[ListedContainer]:
    """Every sandkernel container, from one sparse listing (blocking). Not docker-py's full
    listing: it inspects each container after listing them, and one removed meanwhile (by its
    owner, another gateway, a test) raised NotFound and failed a gateway's start."""
    return [
        ListedContainer(c.id, (c.attrs.get("Names") or [c.id])[0].lstrip("/"), c.attrs.get("Labels") or {})
        for c in engine.client.containers.list(all=True, sparse=True, filters={"label": SESSION_LABEL})
    ]


def _remove_disk(session_id: str, name: str) -> None:
    """The workspace disk of a reaped container (under this process's state dir, if it is there)."""
    try:
        remove_workspace_disk(session_id)
    except (SandkernelError, OSError) as err:
        log.warning("reap: workspace disk of %s: %s", name, err)


class RecordedElsewhere:
    """Whether a container is recorded in the catalog of the state dir it is labelled with, so a
    stopped gateway's next start will adopt it (``sandkernel reap`` or a gateway on another state
    dir must leave it). A catalog that cannot be read counts as recording it: a reaper that
    cannot tell must not destroy tenants' work; so does a state dir whose catalog is a cluster's
    PostgreSQL (a gateway restarting on this engine will adopt them). Each catalog is read once
    per reap."""

    def __init__(self, authoritative: Path | None = None) -> None:
        self._ids: dict[str, set[str] | None] = {}
        self._authoritative = str(authoritative) if authoritative is not None else None

    def __call__(self, labels: dict[str, str]) -> bool:
        directory = labels.get(STATE_DIR_LABEL, "")
        if not directory or not os.path.isabs(directory) or os.path.normpath(directory) != directory:
            return False
        if directory == self._authoritative:
            return False  # the caller's own: its ``keep`` is the whole answer
        if directory not in self._ids:
            try:
                self._ids[directory] = read_session_ids(Path(directory) / CATALOG_NAME)
            except SandkernelError as err:
                log.warning("reap: cannot read the catalog in %s (%s); keeping its sandboxes", directory, err)
                self._ids[directory] = None
        ids = self._ids[directory]
        return ids is None or labels.get(SESSION_LABEL) in ids


async def reap(engine: DockerEngine | None = None, **kwargs: object) -> ReapReport:
    engine = engine or default_engine()
    return await engine.run(reap_sync, engine, **kwargs)
