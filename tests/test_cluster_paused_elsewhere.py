"""A paused session of a host that died resumes on another host of the cluster, when the hosts
share their snapshot dir (issue 18: "paused snapshots on shared storage can resume elsewhere").

Real parts only: ``sandkernel serve`` processes on this machine's Docker engine, a throwaway
PostgreSQL (tests/postgres_fixtures.py), and one directory given to two gateways as their
``--snapshot-dir`` (what an NFS mount on every host is). The catalog half (who may take a paused
row over, and that only one gateway does) is tested on PostgreSQL alone.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sandkernel.gateway.cluster.catalog import ClusterCatalog
from sandkernel.gateway.cluster.postgres import PostgresStore
from sandkernel.kernels.model.records import SandboxRecord, SandboxState
from sandkernel.kernels.snapshots.store import SnapshotStore

from .conftest import container_ids_of
from .gateway_fixtures import BOB
from .test_cluster_membership import clean_up_hosts, cluster_flags, rows, until
from .test_durable_sessions import Serve, code_cells, markdown_text

PAUSED_KERNEL = {"paused": {"id": "0123456789abcdef", "bytes": 10, "cells": 1, "created": 1.0}}


def paused_record(session_id: str, tenant: str = "alice") -> SandboxRecord:
    return SandboxRecord(session_id, "session", PAUSED_KERNEL, state=SandboxState.PAUSED, tenant=tenant)


async def open_hosts(url: str, *host_ids: str) -> tuple[list[PostgresStore], list[ClusterCatalog]]:
    stores = [await PostgresStore.open(url, host_id) for host_id in host_ids]
    return stores, [ClusterCatalog(store, store.host_id) for store in stores]


def mark_down(url: str, host_id: str) -> None:
    rows(url, "UPDATE hosts SET status = 'down' WHERE host_id = %s RETURNING 1", host_id)


@pytest.mark.docker
async def test_only_a_host_sharing_the_down_hosts_snapshot_store_takes_its_paused_session_and_only_once(
    fresh_postgres_url,
):
    url = fresh_postgres_url
    stores, (gone, one, two, other) = await open_hosts(url, "gone", "one", "two", "other")
    try:
        for catalog, store_id in ((gone, "shared"), (one, "shared"), (two, "shared"), (other, "its-own")):
            await catalog.register(f"http://{catalog.host_id}", ["runc"], 10, store_id)
        await stores[0].put(paused_record("p1"))
        await stores[0].put(paused_record("p2"))
        await stores[0].put(SandboxRecord("r1", "session", {"kernel_id": "k"}, tenant="alice"))

        # Its host is up: nobody takes it (the host serves it, forwarded to).
        assert await one.paused_on_down_host("p1", "alice", "shared") is None
        mark_down(url, "gone")
        # Another tenant, another store, a live session: never.
        assert await one.paused_on_down_host("p1", "bob", "shared") is None
        assert await other.paused_on_down_host("p1", "alice", "its-own") is None
        assert await one.paused_on_down_host("r1", "alice", "shared") is None
        found = await one.paused_on_down_host("p1", "alice", "shared")
        assert found is not None and found[1] == "gone" and found[0].state is SandboxState.PAUSED
        assert await one.take_over_paused("p1", "bob", "gone") is None  # the tenant is checked again

        # Two gateways try at once: exactly one gets the row.
        taken = await asyncio.gather(
            one.take_over_paused("p1", "alice", "gone"), two.take_over_paused("p1", "alice", "gone")
        )
        assert sorted(r is not None for r in taken) == [False, True], taken
        winner = "one" if taken[0] is not None else "two"
        assert rows(url, "SELECT host_id, state FROM sandboxes WHERE session_id = 'p1'") == [(winner, "paused")]
        assert [r.session_id for r in await stores[1 if winner == "one" else 2].load()] == ["p1"]
        assert "p1" not in {r.session_id for r in await stores[0].load()}  # the host, back, no longer has it

        # A host that came back keeps the rest: no take-over of an up host's paused session.
        rows(url, "UPDATE hosts SET status = 'up' WHERE host_id = 'gone' RETURNING 1")
        assert await one.take_over_paused("p2", "alice", "gone") is None
        assert rows(url, "SELECT host_id FROM sandboxes WHERE session_id = 'p2'") == [("gone",)]
        # Which ids any host records (what a snapshot sweep over a shared dir keeps).
        assert await one.known_sessions(["p1", "p2", "r1", "nobody"]) == {"p1", "p2", "r1"}
    finally:
        for store in stores:
            await store.close()


def test_stores_on_one_directory_have_one_id_and_others_another(tmp_path):
    shared_a, shared_b = SnapshotStore(tmp_path / "shared"), SnapshotStore(tmp_path / "shared")
    own = SnapshotStore(tmp_path / "own")
    assert shared_a.store_id == shared_b.store_id != own.store_id
    assert len(shared_a.store_id) == 32
    key = (tmp_path / "shared" / "snapshot.key").read_bytes()
    assert key.hex()[:32] != shared_a.store_id and key.hex() not in shared_a.store_id  # the key is not shown


def test_a_part_the_gateway_wrote_is_read_back_only_as_signed(tmp_path):
    from sandkernel.errors import SnapshotRejectedError
    from sandkernel.kernels.snapshots.store import SnapshotManifest

    store = SnapshotStore(tmp_path / "s")
    draft = store.draft("abc-1")
    part = store.write_part(draft, "transcript", b'{"cells": []}')
    manifest = SnapshotManifest(
        snapshot_id=draft.snapshot_id, session_id="abc-1", tenant="alice", kind="pause", created=1.0,
        profile={}, cells=0, replay_from=0, cell=None, parts={"transcript": part},
    )  # fmt: skip
    store.commit(draft, manifest)
    loaded = store.load("abc-1", draft.snapshot_id, "alice")
    assert store.read_part(loaded, "transcript") == b'{"cells": []}'
    # Same size, other bytes: the signed SHA-256 refuses it.
    (draft.directory / "transcript.part").write_bytes(b'{"cells": [1]}'[:13])
    with pytest.raises(SnapshotRejectedError, match="does not match"):
        store.read_part(store.load("abc-1", draft.snapshot_id, "alice"), "transcript")
    with pytest.raises(SnapshotRejectedError, match="no part 'files'"):
        store.read_part(loaded, "files")


@pytest.mark.docker
async def test_a_session_paused_on_a_host_that_died_resumes_on_a_host_sharing_the_snapshot_dir(
    tmp_path, fresh_postgres_url
):
    url = fresh_postgres_url
    shared = tmp_path / "shared-snapshots"
    a, b, c = (Serve(tmp_path / name, "runc") for name in ("a", "b", "c"))
    ids: list[str] = []
    try:
        await b.start(*cluster_flags(tmp_path, url, "host-b", b), "--snapshot-dir", str(shared))
        held = await b.create()  # b is the only host: the session is b's
        sid = held["id"]
        ids.append(sid)
        code = "x = 41\nopen('/workspace/kept.txt', 'w').write('written on b')"
        await b.execute(sid, code)
        status, paused = await b.call("POST", f"/api/sessions/{sid}/pause")
        assert status == 200 and paused["state"] == "paused", paused
        assert not container_ids_of(sid)
        idle = (await b.create())["id"]  # paused too, and nobody will ask for it
        ids.append(idle)
        assert (await b.call("POST", f"/api/sessions/{idle}/pause"))[0] == 200

        # a shares b's snapshot dir; c keeps its own. a's start-up sweep keeps b's snapshot (the
        # catalog records its session), which a sweep of "sessions I do not hold" would delete.
        await a.start(
            *cluster_flags(tmp_path, url, "host-a", a), "--snapshot-dir", str(shared), "--cull-interval", "0.5"
        )
        await c.start(*cluster_flags(tmp_path, url, "host-c", c))
        assert (shared / sid).is_dir(), "a's start-up sweep removed a snapshot of b's"
        stores = dict(rows(url, "SELECT host_id, snapshot_store FROM hosts"))
        assert stores["host-a"] == stores["host-b"] != stores["host-c"] and stores["host-a"], stores

        b.kill9()  # b dies: its paused session has nothing on b but its catalog row
        await until(
            "host-b marked down", lambda: rows(url, "SELECT 1 FROM hosts WHERE host_id = 'host-b' AND status = 'down'")
        )
        assert rows(url, "SELECT host_id, state FROM sandboxes WHERE session_id = %s", sid) == [("host-b", "paused")]

        # c cannot read b's snapshots: the session waits for its host, and c says which.
        status, body = await c.call("POST", f"/api/sessions/{sid}/execute", {"code": "print(x)"})
        assert status == 503 and "host-b" in body["message"], (status, body)
        assert rows(url, "SELECT host_id FROM sandboxes WHERE session_id = %s", sid) == [("host-b",)]
        # Another tenant asking a is told nothing, and takes nothing over.
        status, _ = await a.call("POST", f"/api/sessions/{sid}/execute", {"code": "print(x)"}, token=BOB)
        assert status == 404
        assert rows(url, "SELECT host_id FROM sandboxes WHERE session_id = %s", sid) == [("host-b",)]

        # Its tenant asks a: a takes it over and the execute resumes it there by replay, with its
        # variables and files. Concurrent requests for it wait for the one take-over.
        run = a.execute(sid, "print(x + 1, open('/workspace/kept.txt').read())")
        looks = [a.call("GET", f"/api/sessions/{sid}") for _ in range(3)]
        result, *models = await asyncio.gather(run, *looks)
        assert result["text"] == "42 written on b\n", result
        assert all(status == 200 and model["id"] == sid for status, model in models), models
        assert rows(url, "SELECT host_id, state FROM sandboxes WHERE session_id = %s", sid) == [("host-a", "running")]
        assert container_ids_of(sid)
        assert not (shared / sid).exists() or not any((shared / sid).iterdir())  # the snapshot is used up
        # Its transcript continues on a: the cells from b, the resume, the new cell.
        await a.flushed(sid)
        (transcript,) = (tmp_path / "a" / "notebooks").glob(f"*{sid}.ipynb")
        assert code_cells(str(transcript)) == [code, "print(x + 1, open('/workspace/kept.txt').read())"]
        assert "resumed from a pause" in markdown_text(str(transcript))
        ((gateway,),) = rows(url, "SELECT gateway FROM sandboxes WHERE session_id = %s", sid)
        assert json.loads(gateway)["transcript"] == str(transcript)

        # The paused session nobody asks for expires at its --paused-ttl (7 days) although its host
        # is away: the host sharing the store takes it over and deletes it, snapshot and all.
        assert (shared / idle).is_dir()
        rows(
            url,
            "UPDATE sandboxes SET gateway = jsonb_set(gateway::jsonb, '{paused_at}', '\"2020-01-01T00:00:00.000Z\"')::text "
            "WHERE session_id = %s RETURNING 1",
            idle,
        )  # paused long ago, as far as the record says
        await until(
            "the old paused session expired",
            lambda: not rows(url, "SELECT 1 FROM sandboxes WHERE session_id = %s", idle),
        )
        assert not (shared / idle).exists()
        assert rows(url, "SELECT host_id, state FROM sandboxes WHERE session_id = %s", sid) == [("host-a", "running")]

        # b comes back: the session is a's now, and b forwards to it.
        await b.start(*cluster_flags(tmp_path, url, "host-b", b), "--snapshot-dir", str(shared))
        assert (await b.execute(sid, "print(x)"))["text"] == "41\n"
        assert rows(url, "SELECT host_id FROM sandboxes WHERE session_id = %s", sid) == [("host-a",)]
    finally:
        await clean_up_hosts((a, ids), (b, []), (c, []))
