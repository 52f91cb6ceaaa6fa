"""The audit stream (issue 15, item 4): a hash-chained, rotated JSON Lines log and its verifier.

Pure tier: real files in a temp directory, real worker threads, real child processes for a
crash and a failing disk (RLIMIT_FSIZE makes writes fail with EFBIG, as a full disk would).
What a tenant controls (code, paths, tags) is thrown at the log to show it cannot break a line,
grow a record without bound, or hide in the chain. Tampering of each kind is shown to be caught
and named by file, line and seq; the two kinds a chain cannot catch alone (a cut tail, a full
rewrite) are shown to need, and to be caught with, an anchor.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sandkernel.errors import ConfigError
from sandkernel.gateway.audit import chain, fields
from sandkernel.gateway.audit import log as audit_log
from sandkernel.gateway.audit.log import AuditLog
from sandkernel.gateway.audit.observer import AuditObserver
from sandkernel.gateway.audit.verify import main, verify
from sandkernel.kernels.execution.events import ExecutionRequest
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus, refused_result

from .conftest import RUNTIME_PARAMS, require_runtime
from .gateway_fixtures import start_gateway, stop_gateway


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def records(directory: Path) -> list[dict]:
    out = []
    for path in chain.audit_files(directory):
        out += [json.loads(line) for line in lines(path)]
    return out


async def write(directory: Path, count: int, **options) -> AuditLog:
    audit = AuditLog.open(directory, **options)
    for i in range(count):
        audit.record("execution", tenant="alice", session="s1", door="session_api", code=f"x = {i}", status="ok")
    await audit.flush()
    return audit


async def test_records_are_chained_and_verify_says_intact_with_the_head(tmp_path, capsys):
    audit = await write(tmp_path, 5)
    head = await audit.flush()
    await audit.close()
    got = records(tmp_path)
    assert [r["event"] for r in got] == ["chain_started"] + ["execution"] * 5 + ["log_closed"]
    assert [r["seq"] for r in got] == list(range(7))
    assert got[0]["prev"] == chain.GENESIS
    for before, after in itertools.pairwise(got):
        assert after["prev"] == before["hash"]
    assert got[5]["hash"] == head.hash and got[5]["seq"] == head.seq
    assert got[1]["code_sha256"] == hashlib.sha256(b"x = 0").hexdigest() and got[1]["code"] == "x = 0"
    report = verify([tmp_path / "audit.jsonl"])
    assert report.ok and report.records == 7 and report.head == got[-1]["hash"]
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "7 records" in out and "chain intact" in out and got[-1]["hash"] in out


async def test_files_are_0600_in_a_0700_directory_and_a_loose_directory_is_narrowed(tmp_path):
    directory = tmp_path / "audit"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    audit = await write(directory, 1)
    await audit.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


async def test_a_symlink_planted_as_the_log_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    directory = tmp_path / "audit"
    directory.mkdir(mode=0o700)
    (directory / chain.CURRENT_NAME).symlink_to(victim)
    with pytest.raises(ConfigError, match="audit file"):
        AuditLog.open(directory)
    assert victim.read_text() == "keep me"


async def test_one_writer_per_directory(tmp_path):
    audit = AuditLog.open(tmp_path)
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        AuditLog.open(tmp_path)
    await audit.close()
    second = AuditLog.open(tmp_path)  # the lock went with the first log
    await second.close()
    assert verify([tmp_path]).ok


async def test_what_a_tenant_puts_in_a_field_cannot_break_the_line_or_the_chain(tmp_path):
    hostile = 'a"}\n{"seq":99,"event":"forged","prev":"' + "0" * 64 + '"}\r\n\u2028\u2029\x00\x1b[2J\ud800 é 🙂'
    audit = AuditLog.open(tmp_path)
    audit.record(
        "execution",
        tenant="alice",
        session="s1",
        code=hostile,
        tag=hostile,
        accounting={"files": {"created": [{"path": "dir\n/" + hostile, "sha256": "ab"}]}, "cpu_seconds": float("nan")},
        seq=12345,  # a field named like the log's own keys is renamed, never trusted
        hash="f" * 64,
    )
    await audit.close()
    raw = (tmp_path / chain.CURRENT_NAME).read_bytes()
    assert raw.isascii() and raw.count(b"\n") == 3  # started, execution, closed: one line each
    record = json.loads(raw.splitlines()[1])
    assert record["code"] == hostile and record["tag"] == hostile
    assert record["code_sha256"] == hashlib.sha256(hostile.encode("utf-8", "surrogatepass")).hexdigest()
    assert record["accounting"]["files"]["created"][0]["path"].endswith(hostile)
    assert record["accounting"]["cpu_seconds"] == "nan"
    assert record["seq"] == 1 and record["field_seq"] == 12345 and record["field_hash"] == "f" * 64
    assert verify([tmp_path]).ok


async def test_code_is_capped_with_its_full_sha256_and_can_be_left_out(tmp_path):
    code = "print('a')\n" * 20_000  # 220,000 characters
    full = hashlib.sha256(code.encode()).hexdigest()
    audit = AuditLog.open(tmp_path / "with")
    audit.record("execution", code=code)
    await audit.close()
    kept = records(tmp_path / "with")[1]
    assert kept["code_sha256"] == full and kept["code_chars"] == len(code)
    assert len(kept["code"]) < fields.MAX_CODE_CHARS + 200 and full in kept["code"]  # the marker names it
    assert kept["code"].startswith("print('a')") and "cut here" in kept["code"]

    audit = AuditLog.open(tmp_path / "without", include_code=False)
    audit.record("execution", code=code, shell="rm -rf /workspace/x")
    await audit.close()
    hidden = records(tmp_path / "without")[1]
    assert "code" not in hidden and "shell" not in hidden
    assert hidden["code_sha256"] == full and hidden["code_chars"] == len(code)
    assert hidden["shell_sha256"] == hashlib.sha256(b"rm -rf /workspace/x").hexdigest()


async def test_a_huge_record_is_bounded_and_says_what_it_left_out(tmp_path):
    paths = [{"path": "p" * 10_000 + str(i), "size": i, "sha256": "0" * 64} for i in range(5000)]
    accounting = {"cpu_seconds": 1.5, "files": {"created": paths, "deleted": ["a.txt"]}}
    audit = AuditLog.open(tmp_path)
    audit.record("execution", tenant="alice", session="s1", status="ok", accounting=accounting, tag="t" * 9000)
    await audit.close()
    line = lines(tmp_path / chain.CURRENT_NAME)[1]
    assert len(line) < fields.MAX_RECORD_BYTES
    record = json.loads(line)
    assert record["omitted"] == ["accounting.files.created"]  # only what had to go: the rest of it stays
    created = record["accounting"]["files"]["created"]
    assert created["omitted_bytes"] > fields.MAX_RECORD_BYTES and len(created["sha256"]) == 64
    assert record["accounting"]["cpu_seconds"] == 1.5 and record["accounting"]["files"]["deleted"] == ["a.txt"]
    assert record["tenant"] == "alice" and record["status"] == "ok" and "cut here" in record["tag"]
    assert verify([tmp_path]).ok


async def test_a_record_of_many_small_values_is_bounded_too(tmp_path):
    many = {f"k{i}": "v" * 60 for i in range(fields.MAX_ITEMS)}  # no one value worth replacing alone
    audit = AuditLog.open(tmp_path)
    audit.record("execution", tenant="alice", first=many, second=dict(many))
    await audit.close()
    line = lines(tmp_path / chain.CURRENT_NAME)[1]
    assert len(line) < fields.MAX_RECORD_BYTES
    record = json.loads(line)
    assert record["omitted"] and record["tenant"] == "alice"
    assert verify([tmp_path]).ok


async def test_rotation_keeps_the_chain_and_deletes_only_files_past_their_age(tmp_path, capsys):
    audit = await write(tmp_path, 60, max_bytes=2000, keep_days=1)
    await audit.close()
    young = sorted(p.name for p in tmp_path.glob("audit-*.jsonl"))
    assert len(young) >= 8  # all younger than a day: none deleted, however many
    two_days_ago = time.time() - 2 * 86_400
    for name in [*young[:3], young[5]]:  # the fourth is young: the sixth stays too (no hole in the chain)
        os.utime(tmp_path / name, (two_days_ago, two_days_ago))
    audit = await write(tmp_path, 10, max_bytes=2000, keep_days=1)
    await audit.close()
    rotated = sorted(p.name for p in tmp_path.glob("audit-*.jsonl"))
    assert set(young) - set(rotated) == set(young[:3])
    current = [json.loads(line) for line in lines(tmp_path / chain.CURRENT_NAME)]
    first = current[0]
    assert first["event"] == "log_rotated" and first["previous_file"] == rotated[-1]
    every_rotation = [r for r in records(tmp_path) if r["event"] == "log_rotated"]
    assert sorted(n for r in every_rotation for n in r["removed"]) == young[:3]  # the chain says which went
    previous_last = json.loads(lines(tmp_path / rotated[-1])[-1])
    assert first["prev"] == previous_last["hash"] and first["seq"] == previous_last["seq"] + 1
    for path in tmp_path.glob("audit*.jsonl"):
        assert path.stat().st_size <= 2000
    # any order on the command line (a shell glob sorts audit.jsonl first)
    files = [tmp_path / chain.CURRENT_NAME] + [tmp_path / name for name in reversed(rotated)]
    report = verify(files)
    assert report.ok and report.last_seq == current[-1]["seq"]
    assert any("starts at seq" in note for note in report.notes)  # the deleted files' records are gone


def age(directory: Path, days: float) -> list[str]:
    """Make every rotated file ``days`` old; their names, oldest first."""
    names = sorted(p.name for p in directory.glob("audit-*.jsonl"))
    then = time.time() - days * 86_400
    for name in names:
        os.utime(directory / name, (then, then))
    return names


async def test_a_quiet_log_is_rotated_daily_so_its_old_files_still_age_out(tmp_path, monkeypatch):
    await (await write(tmp_path, 30, max_bytes=2000, keep_days=1)).close()
    old = age(tmp_path, 2)
    monkeypatch.setattr(audit_log, "ROTATE_SECONDS", 0)  # as if the current file was started a day ago
    audit = await write(tmp_path, 1, keep_days=1)  # far from its size: only the day rotates it
    await audit.close()
    rotated = [r for r in records(tmp_path) if r["event"] == "log_rotated"]
    assert sorted(rotated[-1]["removed"]) == old and not set(old) & {p.name for p in tmp_path.iterdir()}
    assert verify([tmp_path]).ok


async def test_reaching_the_budget_deletes_files_past_their_age_at_once(tmp_path):
    await (await write(tmp_path, 60, max_bytes=2000, keep_days=1)).close()
    old = age(tmp_path, 2)
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) > 8000
    audit = AuditLog.open(tmp_path, max_bytes=4000, keep_days=1, max_disk_bytes=8000)
    await audit.flush()
    assert not audit.retention.full  # the room was made by files past their age
    await audit.close()
    rotated = [r for r in records(tmp_path) if r["event"] == "log_rotated"]
    assert sorted(rotated[-1]["removed"]) == old
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) < 8000 and verify([tmp_path]).ok


async def test_a_disk_budget_that_cannot_hold_two_files_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="at least two files"):
        AuditLog.open(tmp_path, max_bytes=1 << 20, max_disk_bytes=1 << 20)


async def test_a_restarted_gateway_continues_the_chain(tmp_path):
    first = await write(tmp_path, 3)
    await first.close()
    second = await write(tmp_path, 2)
    await second.close()
    got = records(tmp_path)
    resumed = [r for r in got if r["event"] == "chain_resumed"]
    assert len(resumed) == 1 and resumed[0]["clean_shutdown"] is True
    assert [r["seq"] for r in got] == list(range(len(got)))
    assert verify([tmp_path]).ok


CHILD = """
import asyncio, os, sys
from pathlib import Path
from sandkernel.gateway.audit.log import AuditLog

async def main():
    audit = AuditLog.open(Path(sys.argv[1]))
    for i in range(5):
        audit.record("execution", code=f"x = {i}")
    await audit.flush()
    os._exit(0)  # a crash: no close, no log_closed

asyncio.run(main())
"""


async def test_after_a_crash_the_next_process_resumes_and_says_it_was_not_clean(tmp_path):
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, str(tmp_path))
    assert await asyncio.wait_for(child.wait(), 60) == 0
    await (await write(tmp_path, 1)).close()
    got = records(tmp_path)
    assert [r["event"] for r in got[-3:]] == ["chain_resumed", "execution", "log_closed"]
    assert got[-3]["clean_shutdown"] is False and got[-3]["seq"] == 6  # after started + 5 executions
    assert verify([tmp_path]).ok


async def test_a_damaged_tail_is_set_aside_recorded_and_accepted_by_verify(tmp_path):
    audit = await write(tmp_path, 3)
    await audit.close()
    current = tmp_path / chain.CURRENT_NAME
    intact = current.read_bytes()
    with current.open("ab") as f:
        f.write(b'{"seq":5,"time":"2026-')  # a write the crash cut short
    damaged = current.read_bytes()
    alone = verify([current])
    assert not alone.ok and alone.fault.line == 6 and "incomplete" in alone.fault.reason

    audit = await write(tmp_path, 1)
    await audit.close()
    aside = tmp_path / chain.rotated_name(0)
    assert aside.read_bytes() == damaged  # kept as it was: evidence, not repaired
    resumed = json.loads(lines(current)[0])
    assert resumed["event"] == "chain_resumed"
    assert resumed["damaged_tail"] == {
        "file": aside.name,
        "offset": len(intact),
        "bytes": len(damaged) - len(intact),
        "sha256": hashlib.sha256(damaged[len(intact) :]).hexdigest(),
    }
    assert resumed["prev"] == json.loads(intact.splitlines()[-1])["hash"]
    report = verify([tmp_path])
    assert report.ok and any("damaged tail" in note for note in report.notes)


async def test_garbage_appended_after_the_recorded_damage_is_a_fault(tmp_path):
    audit = await write(tmp_path, 2)
    await audit.close()
    with (tmp_path / chain.CURRENT_NAME).open("ab") as f:
        f.write(b"garbage\n")
    await (await write(tmp_path, 1)).close()
    aside = tmp_path / chain.rotated_name(0)
    with aside.open("ab") as f:
        f.write(b"more\n")  # not what chain_resumed recorded
    report = verify([tmp_path])
    assert not report.ok and report.fault.file == str(aside) and report.fault.line == 5


@pytest.fixture
async def log_of_ten(tmp_path) -> Path:
    audit = await write(tmp_path, 10)
    await audit.close()
    return tmp_path / chain.CURRENT_NAME


def rewrite(path: Path, edit) -> None:
    data = lines(path)
    edit(data)
    path.write_bytes(b"".join(line + b"\n" for line in data))


async def test_an_edited_line_is_named_by_file_line_and_seq(log_of_ten, capsys):
    rewrite(log_of_ten, lambda data: data.__setitem__(4, data[4].replace(b"x = 3", b"x = 7")))
    report = verify([log_of_ten])
    assert report.fault is not None
    assert (report.fault.file, report.fault.line, report.fault.seq) == (str(log_of_ten), 5, 4)
    assert "does not match its own hash" in report.fault.reason
    assert report.records == 4 and report.head == json.loads(lines(log_of_ten)[3])["hash"]
    assert main([str(log_of_ten)]) == 1
    assert f"{log_of_ten}:5 (seq 4)" in capsys.readouterr().out


async def test_an_edit_with_its_hash_recomputed_breaks_the_next_link(log_of_ten):
    def forge(data):
        record = json.loads(data[4])
        record["code"] = "x = 'forged'"
        del record["hash"]
        data[4] = chain.seal(record)[0].rstrip(b"\n")

    rewrite(log_of_ten, forge)
    report = verify([log_of_ten])
    assert (report.fault.line, report.fault.seq) == (6, 5)
    assert f"{log_of_ten}:5, seq 4" in report.fault.reason and "rewritten" in report.fault.reason


async def test_a_deleted_line_is_named(log_of_ten):
    rewrite(log_of_ten, lambda data: data.pop(4))
    report = verify([log_of_ten])
    assert (report.fault.line, report.fault.seq) == (5, 5) and "1 record(s)" in report.fault.reason


async def test_reordered_lines_are_named(log_of_ten):
    rewrite(log_of_ten, lambda data: data.__setitem__(slice(4, 6), [data[5], data[4]]))
    report = verify([log_of_ten])
    assert (report.fault.line, report.fault.seq) == (5, 5)


async def test_a_line_cut_in_the_middle_is_named(log_of_ten):
    data = log_of_ten.read_bytes()
    log_of_ten.write_bytes(data[: len(data) - 40])
    report = verify([log_of_ten])
    assert report.fault.line == 12 and report.fault.seq is None and "incomplete" in report.fault.reason


async def test_a_cut_tail_needs_an_anchor_and_is_caught_with_one(log_of_ten, capsys):
    head = verify([log_of_ten]).head
    rewrite(log_of_ten, lambda data: data.__delitem__(slice(-3, None)))  # whole lines: the chain is intact
    assert verify([log_of_ten]).ok  # the limit of a chain on its own
    assert main([str(log_of_ten), "--anchor", head]) == 1
    assert f"anchor {head} NOT in the chain" in capsys.readouterr().out
    earlier = json.loads(lines(log_of_ten)[4])["hash"]
    assert main([str(log_of_ten), "--anchor", earlier]) == 0


async def test_a_missing_file_is_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


async def test_record_only_queues_the_work_is_on_the_worker(tmp_path):
    code = "y = 1\n" * 400_000  # 2.4 MB each: hashing and writing 100 of them takes the worker a while
    audit = AuditLog.open(tmp_path)
    started = time.perf_counter()
    for _ in range(100):
        audit.record("execution", code=code)
    queued = time.perf_counter() - started
    await audit.flush()
    written = time.perf_counter() - started
    await audit.close()
    assert queued * 10 < written, (queued, written)
    assert sum(r["event"] == "execution" for r in records(tmp_path)) == 100


async def test_a_full_queue_drops_records_and_the_log_says_how_many(tmp_path, monkeypatch):
    monkeypatch.setattr(audit_log, "QUEUE_LIMIT", 5)
    audit = AuditLog.open(tmp_path)
    for i in range(1000):
        audit.record("execution", code=f"x = {i}")
    await audit.flush()
    audit.record("after")
    await audit.close()
    got = records(tmp_path)
    written = sum(r["event"] == "execution" for r in got)
    dropped = sum(r["dropped"] for r in got if r["event"] == "records_lost")
    assert written < 1000 and written + dropped == 1000  # every record written or counted, none silent
    assert verify([tmp_path]).ok


FAILING_DISK = """
import asyncio, json, os, resource, signal, sys
from pathlib import Path
from sandkernel.gateway.audit.log import AuditLog

async def main():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    audit = AuditLog.open(Path(sys.argv[1]))
    await audit.flush()
    size = (Path(sys.argv[1]) / "audit.jsonl").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 300, hard))  # room for about one record
    for i in range(20):
        audit.record("execution", code=f"x = {i}")  # must not raise
    await audit.flush()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # the disk has room again
    audit.record("execution", code="after")
    await audit.flush()
    await audit.close()

asyncio.run(main())
"""


async def test_failed_writes_never_raise_leave_no_partial_line_and_are_recorded(tmp_path):
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FAILING_DISK, str(tmp_path), stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0, stderr.decode()
    assert b"cannot write an audit record" in stderr  # said in the gateway's log
    got = records(tmp_path)
    written = [r["code"] for r in got if r["event"] == "execution"]
    lost = [r for r in got if r["event"] == "records_lost"]
    assert written[-1] == "after" and len(lost) == 1
    assert len(written) - 1 + lost[0]["failed"] == 20 and "File too large" in lost[0]["error"]
    assert verify([tmp_path]).ok


def managed() -> SimpleNamespace:
    return SimpleNamespace(tenant="alice", id="sess-1")


async def test_the_observer_records_an_execution_with_its_accounting_policy_and_refusal(tmp_path):
    audit = AuditLog.open(tmp_path)
    observer = AuditObserver("alice", "sess-1", audit)
    request = ExecutionRequest(code="!rm -rf /", source="shell", msg_id="m1", timeout=30.0, shell="rm -rf /")
    accounting = {"cpu_seconds": 0.5, "files": {"created": [{"path": "out.csv", "size": 3, "sha256": "a" * 64}]}}
    ran = ExecutionResult(
        ExecutionStatus.OK,
        (),
        3,
        "2026-01-01T00:00:00Z",
        0.7,
        accounting=accounting,
        policy=({"rule": "shell", "action": "warn", "message": "m", "line": 1},),
    )
    refusal = {"by": "policy", "rule": "subprocess", "message": "Rewrite the code without subprocess."}
    await observer.execution_finished(request, ran)
    await observer.execution_finished(request, refused_result(refusal, (), "2026-01-01T00:00:01Z"))
    await observer.kernel_restarted("timeout", True)
    await observer.note_added("a websocket client ran a silent execute")
    await audit.close()
    got = records(tmp_path)[1:-1]
    assert [r["event"] for r in got] == ["execution", "execution", "kernel_restarted", "note"]
    assert all(r["tenant"] == "alice" and r["session"] == "sess-1" for r in got)
    first, second = got[0], got[1]
    assert first["door"] == "shell" and first["shell"] == "rm -rf /" and first["status"] == "ok"
    assert first["accounting"] == accounting and first["policy"][0]["rule"] == "shell"
    assert first["code_sha256"] == hashlib.sha256(b"!rm -rf /").hexdigest()
    assert second["status"] == "refused" and second["refusal"] == refusal and second["error"] == "ExecutionRefused"
    assert got[2]["reason"] == "timeout" and got[2]["container_replaced"] is True
    assert verify([tmp_path]).ok


# -- through a real gateway (Docker, both runtimes) ------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_a_gateway_records_every_change_of_state_in_a_chain_that_verifies(tmp_path, runtime):
    require_runtime(runtime)
    audit_dir = tmp_path / "audit"
    gw = await start_gateway(tmp_path, audit_dir=audit_dir, default_runtime=runtime)
    try:
        status, session = await gw.request("POST", "/api/sessions", {"limits": {"runtime": runtime}})
        assert status == 201, session
        sid = session["id"]
        code = "open('/workspace/out.txt', 'w').write('hello')"
        status, result = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": code})
        assert status == 200 and result["status"] == "ok", result
        status, _ = await gw.request("PUT", f"/api/sessions/{sid}/files/in.csv", raw=b"a,b\n1,2\n")
        assert status in (200, 201), status
        assert (await gw.request("POST", f"/api/sessions/{sid}/restart"))[0] == 200
        assert (await gw.request("DELETE", f"/api/sessions/{sid}"))[0] == 204
    finally:
        await stop_gateway(gw)

    got = records(audit_dir)
    assert got[0]["event"] == "chain_started" and got[-1]["event"] == "log_closed"
    mine = [r for r in got if r.get("session") == sid]
    assert all(r["tenant"] == "alice" for r in mine)
    events = [r["event"] for r in mine]
    for event in ("session_created", "execution", "file_written", "kernel_restarted", "session_deleted"):
        assert event in events, (event, events)
    assert events.index("session_created") < events.index("execution") < events.index("session_deleted")

    execution = mine[events.index("execution")]
    assert execution["door"] == "session_api" and execution["status"] == "ok" and execution["code"] == code
    assert execution["code_sha256"] == hashlib.sha256(code.encode()).hexdigest()
    created = [f for f in execution["accounting"]["files"]["created"] if f["path"].endswith("out.txt")]
    assert created and created[0]["size"] == 5, execution["accounting"]  # the file produced, with its hash
    assert created[0]["sha256"] == hashlib.sha256(b"hello").hexdigest()
    upload = mine[events.index("file_written")]
    assert upload["sha256"] == hashlib.sha256(b"a,b\n1,2\n").hexdigest() and upload["size"] == 8

    report = verify([audit_dir])
    assert report.ok and report.records == len(got), report.summary()
    assert stat.S_IMODE(audit_dir.stat().st_mode) == 0o700


async def test_a_wholly_unreadable_current_file_is_set_aside_and_the_chain_goes_on_from_the_rotated_one(tmp_path):
    audit = await write(tmp_path, 30, max_bytes=2000)
    await audit.close()
    rotated = json.loads(lines(sorted(tmp_path.glob("audit-*.jsonl"))[-1])[-1])
    (tmp_path / chain.CURRENT_NAME).write_bytes(b"\x00" * 100 + b"\n")  # a bad block
    await (await write(tmp_path, 1)).close()
    unreadable = list(tmp_path.glob("audit-unreadable-*.jsonl"))
    assert len(unreadable) == 1 and unreadable[0].read_bytes() == b"\x00" * 100 + b"\n"
    resumed = json.loads(lines(tmp_path / chain.CURRENT_NAME)[0])
    assert resumed["event"] == "chain_resumed" and resumed["prev"] == rotated["hash"]
    assert resumed["damaged_tail"]["file"] == unreadable[0].name
    report = verify([tmp_path])
    assert report.ok and any(unreadable[0].name in note for note in report.notes), report.summary()
