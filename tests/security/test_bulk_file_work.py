"""One tenant's slow snapshot file work cannot hold the gateway's threads (issue 30, item 1's
executor, for snapshot files).

Removing, hashing, copying and moving snapshot files (archives, memory images, disk images) ran
on the event loop's default executor: ``min(32, cores + 4)`` threads, 6 on a 2-core host, which
also carry every other blocking step of the gateway (the store's drafts and commits, transcript
writes, runtime dirs, accounting walks). A tenant whose snapshot files were slow to go (a large
store on a slow disk, or many at once) held them all, and every other tenant's pause, resume and
new session waited. That work now runs in its own pool, each tenant holding at most its share of
it (kernels/sandbox/bulk_io.py).

The slow disk is the one fault here that cannot be caused for real on a test host: the store's
``remove`` is wrapped to wait for the test's word before it removes, for alice's sessions only."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from sandkernel.kernels.sandbox.bulk_io import BULK_IO_PER_OWNER
from sandkernel.kernels.snapshots.store import SnapshotStore

from ..conftest import RUNTIME_PARAMS, container_ids_of, require_runtime
from ..gateway_fixtures import BOB, start_gateway, stop_gateway

pytestmark = pytest.mark.security

# As many stuck removals as the loop's default executor has threads: enough to hold all of them
# when removals run there (asyncio's default: min(32, cores + 4)).
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)
LIVENESS_SECONDS = 60.0  # bob's pause and resume under way; a bound on a hang, not a timing


@pytest.mark.docker
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_tenants_stuck_snapshot_removals_leave_other_tenants_pausing_and_resuming(
    tmp_path, runtime, monkeypatch
):
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, max_sessions=DEFAULT_EXECUTOR_THREADS + 2)
    release, held = threading.Event(), []
    alice_ids: set[str] = set()
    original_remove = SnapshotStore.remove

    def slow_remove(store: SnapshotStore, session_id: str, *args, **kwargs):
        if session_id in alice_ids:
            held.append(session_id)
            release.wait(LIVENESS_SECONDS * 2)
        return original_remove(store, session_id, *args, **kwargs)

    deletes: list[asyncio.Task] = []
    try:
        _, canary = await gw.request("POST", "/api/sessions", {}, token=BOB)
        status, _ = await gw.request("POST", f"/api/sessions/{canary['id']}/execute", {"code": "v = 42"}, token=BOB)
        assert status == 200
        created = await asyncio.gather(
            *(gw.request("POST", "/api/sessions", {}) for _ in range(DEFAULT_EXECUTOR_THREADS))
        )
        assert all(status == 201 for status, _ in created), created
        alice_ids.update(session["id"] for _, session in created)
        monkeypatch.setattr(SnapshotStore, "remove", slow_remove)
        deletes = [asyncio.create_task(gw.request("DELETE", f"/api/sessions/{sid}")) for sid in alice_ids]

        async def alices_share_held() -> None:  # polled on the loop: the default executor may be full
            while len(held) < BULK_IO_PER_OWNER:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(alices_share_held(), LIVENESS_SECONDS)

        async def bob_pauses_and_resumes() -> str:
            status, reply = await gw.request("POST", f"/api/sessions/{canary['id']}/pause", token=BOB)
            assert status == 200, reply
            status, reply = await gw.request(
                "POST", f"/api/sessions/{canary['id']}/execute", {"code": "print(v)"}, token=BOB
            )
            assert status == 200, reply
            return reply["outputs"][0]["text"]

        assert await asyncio.wait_for(bob_pauses_and_resumes(), LIVENESS_SECONDS) == "42\n"
        assert len(held) == BULK_IO_PER_OWNER  # alice's other removals wait for her own threads
        assert not any(task.done() for task in deletes)
    finally:
        release.set()
        answers = await asyncio.gather(*deletes, return_exceptions=True)
        await stop_gateway(gw)
    assert all(not isinstance(a, BaseException) and a[0] == 204 for a in answers), answers
    assert sorted(held) == sorted(alice_ids)  # every removal went through, once
    for sid in alice_ids:  # nothing of alice's sessions is left
        assert await asyncio.to_thread(container_ids_of, sid) == []
        assert await asyncio.to_thread(SnapshotStore(gw.settings.snapshot_dir).list, sid) == []
