"""One tenant cannot flush the audit history of the others (issue 30, item 6).

Rotation used to keep a fixed number of files and an execution record up to 64 Ki characters of
code, so one tenant's burst of large cells deleted everyone's earlier audit files within minutes,
and a full queue dropped records. Now a record keeps a prefix of the code and the SHA-256 of all
of it; files are kept by age (never deleted younger than ``keep_days``) within a disk budget; and
the log fails closed for the tenant loading it: the audit gate refuses that tenant's executions
before they run (its rate of audit bytes, the queue's high-water mark, a budget full of young
history), while the others go on and nothing already recorded is lost.

Pure tests drive the real log, the real gate and the real observer the gateway attaches to every
session (gateway/controls.py), with real ExecutionRequests; the last test runs a gateway.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest

from sandkernel.gateway.audit import chain, fields
from sandkernel.gateway.audit import log as audit_log
from sandkernel.gateway.audit.gate import AuditGate
from sandkernel.gateway.audit.log import AuditLog
from sandkernel.gateway.audit.observer import AuditObserver
from sandkernel.gateway.audit.usage import DISK_BUDGET, QUEUE_HIGH_WATER, TENANT_RATE, TenantWindow
from sandkernel.gateway.audit.verify import verify
from sandkernel.kernels.execution.events import ExecutionRequest
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus, refused_result

from ..conftest import RUNTIME_PARAMS, require_runtime
from ..gateway_fixtures import ALICE, BOB, start_gateway, stop_gateway

pytestmark = pytest.mark.security
KiB, MiB = 2**10, 2**20
DAY = 86_400


class Tenant:
    """One tenant's session as the gateway equips it: the audit gate before, the observer after."""

    def __init__(self, audit: AuditLog, name: str) -> None:
        self.gate = AuditGate(audit, name)
        self.observer = AuditObserver(name, f"{name}-session", audit)
        self.ran = 0
        self.refusals: list[dict] = []

    async def execute(self, code: str) -> bool:
        """Ask the gate, then record what happened as the session would; whether it ran."""
        request = ExecutionRequest(code=code, source="session_api", msg_id="", timeout=30.0)
        verdict = await self.gate.admit(request)
        if verdict.refusal is not None:
            self.refusals.append(verdict.refusal)
            result = refused_result(verdict.refusal, verdict.findings, "2026-01-01T00:00:00Z")
        else:
            self.ran += 1
            result = ExecutionResult(ExecutionStatus.OK, (), self.ran, "2026-01-01T00:00:00Z", 0.01)
        await self.observer.execution_finished(request, result)
        return verdict.refusal is None


def all_records(directory: Path) -> list[dict]:
    return [json.loads(line) for path in chain.audit_files(directory) for line in path.read_bytes().splitlines()]


def large_cell(i: int) -> str:
    return f"# cell {i}\n" + "x = 'a large cell, the kind a burst is made of'\n" * 1500  # ~70 KB


async def test_a_burst_of_large_cells_leaves_another_tenants_earlier_records_in_place(tmp_path):
    audit = AuditLog.open(
        tmp_path, max_bytes=64 * KiB, keep_days=7, max_disk_bytes=2 * MiB, tenant_bytes_per_minute=256 * KiB
    )
    alice, bob = Tenant(audit, "alice"), Tenant(audit, "bob")
    for i in range(20):
        assert await bob.execute(f"total = {i}")
    await audit.flush()
    bobs = {r["hash"] for r in all_records(tmp_path) if r.get("tenant") == "bob"}
    assert len(bobs) == 20

    for i in range(400):  # the burst: far more than the old keep=10 rotations' worth
        await alice.execute(large_cell(i))
        await audit.flush()  # as fast as the writer goes
    await audit.close()

    assert alice.ran and alice.refusals  # ran, until it passed its own rate
    assert {r["by"] for r in alice.refusals} == {"audit"} and alice.refusals[0]["rule"] == TENANT_RATE
    assert 0 < alice.refusals[0]["retry_after"] <= 60 and "Retry in" in alice.refusals[0]["message"]
    got = all_records(tmp_path)
    assert bobs <= {r["hash"] for r in got}  # every one of bob's records is still in the retained history
    assert not [r for r in got if r["event"] == "log_rotated" and r["removed"]]  # nothing young was deleted
    assert not [r for r in got if r["event"] == "records_lost"]
    executions = [r for r in got if r["event"] == "execution" and r["tenant"] == "alice"]
    assert len(executions) == 400  # every attempt is on record, the refused ones too
    refused = [r for r in executions if r["status"] == "refused"]
    assert len(refused) == len(alice.refusals) and all("code" not in r and r["code_chars"] > 60_000 for r in refused)
    report = verify([tmp_path])
    assert report.ok and report.first_seq == 0, report.summary()


async def test_a_record_keeps_a_prefix_of_the_code_and_the_sha256_of_all_of_it(tmp_path):
    code = "print('a line of a huge cell')\n" * 40_000  # 1.2 MB
    audit = AuditLog.open(tmp_path)
    audit.record("execution", tenant="alice", session="s1", code=code, shell=code)
    await audit.close()
    line = (tmp_path / chain.CURRENT_NAME).read_bytes().splitlines()[1]
    assert len(line) < 16 * KiB  # 64 Ki characters of each before
    record = json.loads(line)
    assert record["code"].startswith(code[: fields.MAX_CODE_CHARS]) and fields.MAX_CODE_CHARS <= 4096
    assert record["code"][fields.MAX_CODE_CHARS :].strip().startswith("…[sandkernel:")  # a prefix, then the marker
    assert record["code_sha256"] == hashlib.sha256(code.encode()).hexdigest() == record["shell_sha256"]
    assert record["code_chars"] == len(code) and record["code_sha256"] in record["code"]
    assert verify([tmp_path]).ok


async def test_a_tenant_over_its_rate_is_refused_and_another_tenant_is_not(tmp_path):
    audit = AuditLog.open(tmp_path, tenant_bytes_per_minute=64 * KiB)
    alice, bob = Tenant(audit, "alice"), Tenant(audit, "bob")
    while await alice.execute(large_cell(alice.ran)):
        await audit.flush()
        assert alice.ran < 100
    assert alice.ran >= 10  # 64 KiB a minute is about 13 cells' prefixes
    refusal = alice.refusals[0]
    assert (refusal["by"], refusal["rule"]) == ("audit", TENANT_RATE)
    assert "over the operator's limit of 64 KiB per minute" in refusal["message"]
    assert await bob.execute("y = 2") and not bob.refusals
    assert not await alice.execute("z = 3")  # still refused, whatever the cell
    await audit.close()
    assert verify([tmp_path]).ok

    window = TenantWindow()  # and the minute passes: the same counts, at a chosen time
    for second in range(10):
        window.add("alice", 10 * KiB, now=1000.0 + second)
    assert window.total("alice", now=1009.5) == 100 * KiB
    assert window.seconds_until_within("alice", 64 * KiB, now=1009.5) == 54  # when its 4th second leaves
    assert window.total("alice", now=1070.0) == 0 and window.seconds_until_within("alice", 64 * KiB, now=1070.0) == 0


async def test_past_the_queues_high_water_mark_the_tenant_queueing_most_is_refused_and_nothing_is_dropped(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(audit_log, "QUEUE_LIMIT", 100)  # high water at 80
    audit = AuditLog.open(tmp_path)
    alice, bob = Tenant(audit, "alice"), Tenant(audit, "bob")
    entered, release = threading.Event(), threading.Event()
    append = audit._append

    def stalled(*args):  # a disk that stalls: the writer is stuck on one record, the queue fills
        entered.set()
        release.wait(30)
        return append(*args)

    audit._append = stalled  # type: ignore[method-assign]
    audit.record("note", text="the writer is stuck on this one")
    assert entered.wait(10)
    for i in range(90):
        await alice.execute(f"a = {i}")
    for i in range(3):
        assert await bob.execute(f"b = {i}")  # bob's few records are not the flood
    release.set()
    await audit.flush()
    audit._append = append  # type: ignore[method-assign]
    assert alice.ran >= 75 and alice.refusals
    assert {(r["by"], r["rule"]) for r in alice.refusals} == {("audit", QUEUE_HIGH_WATER)}
    assert await alice.execute("a = 'the writer caught up'")
    await audit.close()
    got = all_records(tmp_path)
    assert not [r for r in got if r["event"] == "records_lost"]  # refused in time: nothing dropped
    assert sum(r["event"] == "execution" for r in got) == 90 + 3 + 1
    assert verify([tmp_path]).ok


async def test_files_are_deleted_by_age_only_however_much_one_tenant_writes(tmp_path):
    options = {"max_bytes": 16 * KiB, "keep_days": 7}
    audit = AuditLog.open(tmp_path, **options)
    for i in range(20):
        audit.record("execution", tenant="bob", session="b", code=f"total = {i}")
    await audit.flush()
    for i in range(300):  # 300 files' worth: the old keep=10 deleted bob's after ten of them
        audit.record("execution", tenant="alice", session="a", code=large_cell(i))
    await audit.close()
    rotated = sorted(p.name for p in tmp_path.glob("audit-*.jsonl"))
    assert len(rotated) >= 50
    assert all(r["removed"] == [] for r in all_records(tmp_path) if r["event"] == "log_rotated")
    assert sum(r.get("tenant") == "bob" for r in all_records(tmp_path)) == 20 and verify([tmp_path]).ok

    eight_days_ago = time.time() - 8 * DAY
    for name in rotated[:5]:  # past their age
        os.utime(tmp_path / name, (eight_days_ago, eight_days_ago))
    audit = AuditLog.open(tmp_path, **options)
    for i in range(5):  # to the next rotation
        audit.record("execution", tenant="alice", session="a", code=large_cell(i))
    await audit.close()
    kept = sorted(p.name for p in tmp_path.glob("audit-*.jsonl"))
    assert set(rotated) - set(kept) == set(rotated[:5])
    removed = [n for r in all_records(tmp_path) if r["event"] == "log_rotated" for n in r["removed"]]
    assert sorted(removed) == rotated[:5]  # and the chain says which
    assert verify([tmp_path]).ok


async def test_a_budget_full_of_young_history_refuses_the_tenant_holding_most_of_it_even_after_a_restart(tmp_path):
    options = {"max_bytes": 32 * KiB, "keep_days": 7, "max_disk_bytes": 256 * KiB}
    audit = AuditLog.open(tmp_path, **options)
    alice, bob = Tenant(audit, "alice"), Tenant(audit, "bob")
    for i in range(10):
        assert await bob.execute(f"total = {i}")
    while await alice.execute(large_cell(alice.ran)):
        await audit.flush()
        assert alice.ran < 200
    refusal = alice.refusals[0]
    assert (refusal["by"], refusal["rule"]) == ("audit", DISK_BUDGET) and "full of records" in refusal["message"]
    assert refusal["retry_after"] >= 60
    assert await bob.execute("y = 1")  # bob holds little of it: he goes on
    await audit.close()
    used = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert 256 * KiB <= used <= 256 * KiB + 32 * KiB  # nothing deleted to make room, and the growth stopped
    assert sum(r.get("tenant") == "bob" for r in all_records(tmp_path)) == 11

    audit = AuditLog.open(tmp_path, **options)  # a restarted gateway knows who holds the history
    alice, bob = Tenant(audit, "alice"), Tenant(audit, "bob")
    assert not await alice.execute("x = 1") and alice.refusals[0]["rule"] == DISK_BUDGET
    assert await bob.execute("y = 2")
    await audit.close()
    assert verify([tmp_path]).ok


# -- through a real gateway (Docker) ---------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_gateway_refuses_the_tenant_flooding_its_audit_log_and_runs_the_other(tmp_path, runtime):
    require_runtime(runtime)
    audit_dir = tmp_path / "audit"
    gw = await start_gateway(tmp_path, audit_dir=audit_dir, default_runtime=runtime, audit_tenant_mb_per_minute=1)
    try:
        sessions = {}
        for token in (ALICE, BOB):
            status, session = await gw.request("POST", "/api/sessions", {"limits": {"runtime": runtime}}, token=token)
            assert status == 201, session
            sessions[token] = session["id"]
        code = "x = 1\n" + "# padding of a large cell\n" * 1000  # each record keeps a 4 KiB prefix
        refused = None
        for _ in range(600):  # 1 MiB a minute is some 200 such records
            status, reply = await gw.request("POST", f"/api/sessions/{sessions[ALICE]}/execute", {"code": code})
            assert status == 200, reply
            if reply["status"] == "refused":
                refused = reply
                break
        assert refused is not None, "the flooding tenant was never refused"
        assert refused["refusal"]["by"] == "audit" and refused["refusal"]["rule"] == TENANT_RATE
        assert refused["execution_count"] is None and "Retry in" in refused["refusal"]["message"]
        status, reply = await gw.request("POST", f"/api/sessions/{sessions[BOB]}/execute", {"code": "1 + 1"}, token=BOB)
        assert status == 200 and reply["status"] == "ok", reply
    finally:
        await stop_gateway(gw)
    got = all_records(audit_dir)
    assert any(r["event"] == "execution" and r.get("tenant") == "bob" and r["status"] == "ok" for r in got)
    assert verify([audit_dir]).ok
