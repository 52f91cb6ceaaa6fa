"""The reaper removes only runtime dirs under its own base: a container label is data anyone
with Docker access can write, so ``sandkernel.runtime_dir=/etc`` must not delete /etc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import tempfile
from pathlib import Path

import docker.errors
import pytest

from sandkernel.kernels.durable.store import CATALOG_NAME, open_store
from sandkernel.kernels.lifecycle.reaper import reap_sync
from sandkernel.kernels.model.profiles import resolve_profile
from sandkernel.kernels.model.records import SandboxRecord
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, RUNTIME_DIR_LABEL, SESSION_LABEL
from sandkernel.kernels.sandbox.runtime_dir import default_base_dir
from sandkernel.kernels.sandbox.state_dir import STATE_DIR_LABEL

# Exclusive: its containers have dead owners, which any gateway another test starts meanwhile (a
# parallel run) would reap first, as it should.
pytestmark = [pytest.mark.security, pytest.mark.docker, pytest.mark.exclusive]


def victim() -> Path:
    path = Path(tempfile.mkdtemp(prefix="sk-victim-", dir="/tmp"))
    (path / "precious").write_text("keep me")
    return path


def test_hostile_runtime_dir_labels_remove_nothing_outside_the_base():
    base = default_base_dir()
    base.mkdir(parents=True, exist_ok=True)
    outside, via_symlink, via_dotdot = victim(), victim(), victim()
    link = base / secrets.token_hex(6)  # a well-formed name under the base that is a symlink out
    link.symlink_to(via_symlink)
    labels = [
        str(outside),
        str(link),
        f"{base}/../../{via_dotdot.relative_to('/')}",
        f"{outside}/.",
    ]
    dead_owner = f"{socket.gethostname()}:999999999:1"  # no such pid: the reaper treats it as dead
    engine = default_engine()
    created = [
        engine.client.containers.create(
            resolve_profile().image,
            labels={SESSION_LABEL: f"hostile-{i}", OWNER_LABEL: dead_owner, RUNTIME_DIR_LABEL: label},
        )
        for i, label in enumerate(labels)
    ]
    try:
        report = reap_sync(engine, owner=dead_owner)
        assert sorted(report.removed) == sorted(c.name for c in created)
        for path in (outside, via_symlink, via_dotdot):
            assert (path / "precious").read_text() == "keep me", f"the reaper deleted {path}"
        assert link.is_symlink(), "the reaper removed a symlink it should not have followed or touched"
    finally:
        for c in created:
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True)
        link.unlink(missing_ok=True)
        for path in (outside, via_symlink, via_dotdot):
            for entry in path.iterdir():
                entry.unlink()
            path.rmdir()


def test_the_reaper_still_removes_its_own_runtime_dirs():
    base = default_base_dir()
    base.mkdir(parents=True, exist_ok=True)
    mine = base / secrets.token_hex(6)
    mine.mkdir(mode=0o700)
    (mine / "k-1").write_text("")
    dead_owner = f"{socket.gethostname()}:999999998:1"
    engine = default_engine()
    c = engine.client.containers.create(
        resolve_profile().image,
        labels={SESSION_LABEL: "reaped", OWNER_LABEL: dead_owner, RUNTIME_DIR_LABEL: str(mine)},
    )
    try:
        assert reap_sync(engine, owner=dead_owner).removed == (c.name,)
        assert not os.path.lexists(mine)
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            c.remove(force=True)


def test_a_sandbox_recorded_in_its_state_dirs_catalog_is_spared_until_the_catalog_lets_go(tmp_path):
    """A stopped gateway's sandboxes carry a dead owner label: a reaper run by anyone else (another
    state dir's gateway, ``sandkernel reap``) must leave those the labelled catalog records, and
    those of a catalog it cannot read, but still reap the rest."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = open_store(state / CATALOG_NAME)
    session_id = secrets.token_hex(16)
    asyncio.run(store.put(SandboxRecord(session_id, "session", {})))
    asyncio.run(store.close())
    dead_owner = f"{socket.gethostname()}:999999997:1"
    engine = default_engine()
    labels = {OWNER_LABEL: dead_owner, STATE_DIR_LABEL: str(state)}
    recorded = engine.client.containers.create(resolve_profile().image, labels={**labels, SESSION_LABEL: session_id})
    unrecorded = engine.client.containers.create(resolve_profile().image, labels={**labels, SESSION_LABEL: "stray"})
    try:
        report = reap_sync(engine)
        assert unrecorded.name in report.removed and recorded.name not in report.removed
        catalog = state / CATALOG_NAME
        catalog.write_bytes(b"not a catalog" * 100)  # damaged: the reaper cannot tell, so it keeps
        assert recorded.name not in reap_sync(engine).removed
        catalog.unlink()  # the session was deleted with its catalog: nothing holds the sandbox
        assert recorded.name in reap_sync(engine).removed
    finally:
        for container in (recorded, unrecorded):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
