"""A tenant's snapshot quota holds while its snapshots are being written (issue 30, item 4).

The quota used to be checked against committed snapshots before a capture began, and each capture
could then write all that was left: concurrent pauses (and per-cell checkpoints, which take no
lock) could each write up to the whole quota. Every byte is now taken from the tenant's room as
it is written, shared by its captures under way (kernels/snapshots/quota.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from sandkernel.kernels.snapshots.quota import TenantSnapshotBytes, WrittenInWindow
from sandkernel.kernels.snapshots.store import SnapshotStore

from ..conftest import RUNTIME_PARAMS, container_ids_of, require_runtime
from ..gateway_fixtures import BOB, start_gateway, stop_gateway

pytestmark = pytest.mark.security
MiB = 2**20


def test_captures_under_way_are_served_oldest_first_and_never_commit_past_the_quota():
    tenant = TenantSnapshotBytes()
    assert tenant.refresh(lambda: 2 * MiB) == 2 * MiB  # committed, from the store's walk
    quota = 10 * MiB
    allowances = [tenant.allowance(quota) for _ in range(8)]
    finished = [False] * len(allowances)

    def capture(i: int) -> None:  # each writes 4 MiB in 64 KiB pieces, as a capture's thread does
        for _ in range(64):
            if not allowances[i].take(64 * 1024):
                return
        finished[i] = True

    threads = [threading.Thread(target=capture, args=(i,)) for i in range(len(allowances))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert finished[0] and finished[1]  # 2 + 4 + 4 fit: the two oldest never give way
    # each commits if it still fits, in any order: never past the quota
    kept = [a.claim() for a in reversed(allowances) if finished[allowances.index(a)]]
    for allowance in allowances:
        allowance.settle(kept=allowance.claimed)
    assert tenant.used <= quota
    assert allowances[0].claimed and allowances[1].claimed
    assert tenant.used == 2 * MiB + sum(a.taken for a in allowances if a.claimed)
    assert kept.count(True) == sum(a.claimed for a in allowances)


def test_three_captures_that_fit_alone_but_not_together_keep_the_oldest():
    """The case a shared room without an order got wrong: all three ran out halfway, none kept."""
    tenant = TenantSnapshotBytes()
    tenant.refresh(lambda: 0)
    first, second, third = (tenant.allowance(8 * MiB) for _ in range(3))
    for _ in range(5):  # lockstep: a MiB each in turn
        for allowance in (first, second, third):
            allowance.take(MiB)
    assert (first.taken, second.taken, third.taken) == (5 * MiB, 4 * MiB, 2 * MiB)  # the youngest gave way first
    assert first.claim() and not second.claim()
    for allowance in (first, second, third):
        allowance.settle(kept=allowance.claimed)
    assert tenant.used == 5 * MiB


def test_settled_bytes_move_to_committed_and_a_stale_walk_is_not_applied():
    tenant = TenantSnapshotBytes()
    tenant.refresh(lambda: 0)
    first = tenant.allowance(10 * MiB)
    assert first.take(3 * MiB)
    assert tenant.used == 3 * MiB
    second = tenant.allowance(10 * MiB)
    assert not second.take(8 * MiB) and second.taken == 0  # 3 + 8 > 10: nothing taken
    assert first.claim()
    first.settle(kept=True)
    assert tenant.used == 3 * MiB  # committed now, not written
    second.settle(kept=False)
    failed = tenant.allowance(10 * MiB)
    assert failed.take(MiB) and failed.claim()
    failed.settle(kept=False)  # claimed, then the store's commit failed: its bytes are free again
    assert tenant.used == 3 * MiB

    def walk_that_misses_a_commit() -> int:  # a capture commits while the store is walked
        late = tenant.allowance(10 * MiB)
        late.take(2 * MiB)
        late.claim()
        late.settle(kept=True)
        return 3 * MiB  # the walk did not see it

    assert tenant.refresh(walk_that_misses_a_commit) == 5 * MiB  # the stale walk is not applied
    assert tenant.refresh(lambda: 5 * MiB) == 5 * MiB


# Incompressible files, so the archive is about their size.
WRITE = "import os; open('/workspace/blob', 'wb').write(os.urandom({mib} * 2**20)); v = {value}"


@pytest.mark.docker
@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_concurrent_pauses_cannot_pass_the_quota_together_and_the_canary_answers(tmp_path, runtime):
    """Three sessions of 5 MiB against an 8 MiB quota, paused at once: one fits and is kept, the
    others are 409s that leave their session live with its state; what the store holds stays
    under the quota (before: all three were written, 15 MiB). Another tenant's execute answers
    meanwhile."""
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, snapshot_quota_mb=8)
    try:
        sessions = []
        for value in range(3):
            _, session = await gw.request("POST", "/api/sessions", {})
            status, reply = await gw.request(
                "POST", f"/api/sessions/{session['id']}/execute", {"code": WRITE.format(mib=5, value=value)}
            )
            assert status == 200 and reply["status"] == "ok", reply
            sessions.append(session["id"])
        _, canary = await gw.request("POST", "/api/sessions", {}, token=BOB)
        answers = await asyncio.gather(
            *(gw.request("POST", f"/api/sessions/{sid}/pause") for sid in sessions),
            gw.request("POST", f"/api/sessions/{canary['id']}/execute", {"code": "print(6 * 7)"}, token=BOB),
        )
        *pauses, (canary_status, canary_reply) = answers
        assert canary_status == 200 and canary_reply["outputs"][0]["text"] == "42\n", canary_reply
        paused = [sid for sid, (status, _) in zip(sessions, pauses, strict=True) if status == 200]
        refused = [(sid, body) for sid, (status, body) in zip(sessions, pauses, strict=True) if status == 409]
        assert len(paused) == 1 and len(refused) == 2, pauses
        assert all(body["error"] == "snapshot_quota_exceeded" for _, body in refused), refused
        store = SnapshotStore(gw.settings.snapshot_dir)
        assert await asyncio.to_thread(store.tenant_bytes, "alice") <= 8 * MiB
        for sid, _ in refused:  # still live, state and files kept, no draft left behind
            status, reply = await gw.request(
                "POST", f"/api/sessions/{sid}/execute", {"code": "import os; print(v, os.path.getsize('/workspace/blob'))"}
            )
            assert status == 200 and reply["outputs"][0]["text"].split()[1] == str(5 * MiB), reply
            assert await asyncio.to_thread(container_ids_of, sid)
            assert await asyncio.to_thread(store.list, sid) == []
    finally:
        await stop_gateway(gw)


def test_what_was_written_counts_for_its_window_only():
    window = WrittenInWindow(60)
    window.add(3 * MiB, now=0)
    window.add(MiB, now=30)
    assert window.total(now=59) == 4 * MiB
    assert window.total(now=60) == MiB  # the first write is a minute old
    assert window.total(now=91) == 0


@pytest.mark.docker
@pytest.mark.parametrize("runtime", [RUNTIME_PARAMS[0]])
async def test_per_cell_checkpoints_write_at_most_their_bytes_per_minute(tmp_path, runtime):
    """--checkpoint-every-cell over a 2 MiB workspace with a 1 MiB-per-minute bound: the first
    cell's checkpoint is taken, the next cells go on without one (their replies are fine)."""
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, checkpoint_every_cell=True, checkpoint_mb_per_minute=1)
    try:
        _, session = await gw.request("POST", "/api/sessions", {})
        sid = session["id"]
        for value in range(4):
            code = WRITE.format(mib=2, value=value) if value == 0 else f"v = {value}"
            status, reply = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": code})
            assert status == 200 and reply["status"] == "ok", reply
        store = SnapshotStore(gw.settings.snapshot_dir)
        kept = [m.cell for m in await asyncio.to_thread(store.list, sid) if m.kind == "cell"]
        assert kept == [1], kept
    finally:
        await stop_gateway(gw)
