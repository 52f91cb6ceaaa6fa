"""kernels/snapshots/store.py on a temp directory (pure: no Docker).

A snapshot is tenant data on the gateway's disk: these tests show it is kept 0600/0700, never
read or written through a symlink, named only by checked ids, and loaded only when its signed
manifest is unaltered and names the session and tenant asking for it. Part *content* is not
checked here (only part sizes): restore_files hashes the archive while it reads it, see
tests/test_snapshot_archive.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path

import pytest

from sandkernel.errors import ConfigError, SnapshotError, SnapshotRejectedError
from sandkernel.kernels.snapshots import store as store_module
from sandkernel.kernels.snapshots.archive import ArchivePart
from sandkernel.kernels.snapshots.store import (
    KEY_FILE,
    MANIFEST,
    SnapshotDraft,
    SnapshotManifest,
    SnapshotStore,
)

TENANT = "alice"
OTHER_TENANT = "mallory"


def session() -> str:
    return uuid.uuid4().hex


def take(
    store: SnapshotStore, session_id: str, tenant: str = TENANT, data: bytes = b"tar bytes", **fields
) -> SnapshotManifest:
    """A committed snapshot whose "files" part holds ``data``."""
    draft = store.draft(session_id)
    path = draft.part_path("files")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return store.commit(draft, manifest_for(draft, tenant, data, **fields))


def manifest_for(draft: SnapshotDraft, tenant: str, data: bytes, **fields) -> SnapshotManifest:
    values = {
        "snapshot_id": draft.snapshot_id,
        "session_id": draft.session_id,
        "tenant": tenant,
        "kind": "pause",
        "created": time.time(),
        "profile": {"name": "default", "memory": "512m"},
        "cells": 3,
        "replay_from": 1,
        "cell": None,
        "parts": {"files": ArchivePart(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())},
        "extra": {"transcript": "t.ipynb"},
    }
    values.update(fields)
    return SnapshotManifest(**values)


def directory(store: SnapshotStore, manifest: SnapshotManifest) -> Path:
    return store.root / manifest.session_id / manifest.snapshot_id


def rewrite_manifest(store: SnapshotStore, manifest: SnapshotManifest, change) -> None:
    """Edit manifest.json in place (keeping its stored hmac), as someone with disk access could."""
    path = directory(store, manifest) / MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def dir_bytes(store: SnapshotStore, manifest: SnapshotManifest) -> int:
    return sum(path.stat().st_size for path in directory(store, manifest).iterdir())


def dir_bytes_at(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir())


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def store(tmp_path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "snapshots")


# -- the round trip and what is on disk ----------------------------------------------------------


def test_round_trip_loads_what_was_committed(store):
    sid = session()
    taken = take(store, sid, kind="cell", cell=2, data=b"\x00binary\xff" * 100)
    loaded = store.load(sid, taken.snapshot_id, TENANT)
    assert loaded == taken and loaded.bytes == 800
    assert store.part_path(loaded, "files").read_bytes() == b"\x00binary\xff" * 100
    assert store.list(sid) == [taken] and store.sessions() == [sid]
    on_disk = json.loads((directory(store, taken) / MANIFEST).read_text())
    assert len(on_disk["hmac"]) == 64 and on_disk["tenant"] == TENANT
    with pytest.raises(KeyError, match="no part 'memory'"):
        store.part_path(loaded, "memory")


def test_modes_are_0700_dirs_and_0600_files_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        store = SnapshotStore(tmp_path / "snapshots")
        sid = session()
        draft = store.draft(sid)
        draft.part_path("files").write_bytes(b"x")  # umask 0: 0666, a careless writer
        assert mode(draft.part_path("files")) == 0o666
        taken = store.commit(draft, manifest_for(draft, TENANT, b"x"))
    finally:
        os.umask(old)
    assert mode(store.root) == 0o700 and mode(store.root / sid) == 0o700 and mode(directory(store, taken)) == 0o700
    assert mode(store.root / KEY_FILE) == 0o600
    assert mode(directory(store, taken) / MANIFEST) == 0o600
    assert mode(store.part_path(taken, "files")) == 0o600  # narrowed at commit
    assert sorted(os.listdir(directory(store, taken))) == ["files.part", MANIFEST]  # no temp file left


def test_a_wider_root_or_session_dir_is_narrowed_to_0700(store):
    sid = session()
    taken = take(store, sid)
    os.chmod(store.root, 0o755)
    os.chmod(store.root / sid, 0o755)
    again = SnapshotStore(store.root)
    again.load(sid, taken.snapshot_id, TENANT)
    assert mode(store.root) == 0o700 and mode(store.root / sid) == 0o700


# -- the key --------------------------------------------------------------------------------------


def test_key_is_made_once_and_reused_across_instances(tmp_path):
    first = SnapshotStore(tmp_path / "s")
    key = (tmp_path / "s" / KEY_FILE).read_bytes()
    sid = session()
    taken = take(first, sid)
    second = SnapshotStore(tmp_path / "s")
    assert (tmp_path / "s" / KEY_FILE).read_bytes() == key and len(key) == 32
    assert second.load(sid, taken.snapshot_id, TENANT) == taken
    assert sorted(os.listdir(tmp_path / "s")) == sorted([KEY_FILE, sid])


def test_stores_started_together_agree_on_one_key(tmp_path):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    keys: list[bytes] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        keys.append(SnapshotStore(root)._key)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert os.listdir(root) == [KEY_FILE]  # no temp key file left behind
    assert (root / KEY_FILE).read_bytes() == keys[0]


def test_a_new_key_refuses_every_snapshot_signed_with_the_old_one(store):
    sid = session()
    taken = take(store, sid)
    (store.root / KEY_FILE).unlink()
    fresh = SnapshotStore(store.root)
    with pytest.raises(SnapshotRejectedError, match="HMAC does not match"):
        fresh.load(sid, taken.snapshot_id, TENANT)


def test_a_symlinked_key_is_refused_and_its_target_untouched(tmp_path):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"k" * 32)  # a well-formed key somewhere else: following the link would "work"
    (root / KEY_FILE).symlink_to(victim)
    with pytest.raises(ConfigError, match="symlink"):
        SnapshotStore(root)
    assert victim.read_bytes() == b"k" * 32 and (root / KEY_FILE).is_symlink()
    dangling = tmp_path / "d"
    dangling.mkdir(mode=0o700)
    (dangling / KEY_FILE).symlink_to(tmp_path / "nowhere")  # not made through a dangling link either
    with pytest.raises(ConfigError, match="symlink"):
        SnapshotStore(dangling)
    assert not (tmp_path / "nowhere").exists()


def test_a_key_of_the_wrong_size_is_refused_not_replaced(tmp_path):
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    (root / KEY_FILE).write_bytes(b"short")
    with pytest.raises(ConfigError, match="5 bytes long, not 32"):
        SnapshotStore(root)
    assert (root / KEY_FILE).read_bytes() == b"short"


def test_a_key_readable_by_others_is_narrowed(store):
    os.chmod(store.root / KEY_FILE, 0o644)
    SnapshotStore(store.root)
    assert mode(store.root / KEY_FILE) == 0o600


# -- tampering: each kind named -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("tenant", OTHER_TENANT),  # re-labelled to another tenant
        ("cells", 99),
        ("replay_from", 0),  # replay more than was recorded as safe
        ("kind", "fork"),
        ("created", 0.0),
        ("profile", {"name": "default", "memory": "64g"}),  # a bigger sandbox on resume
        ("extra", {"transcript": "../../etc/passwd"}),
    ],
)
def test_an_altered_manifest_field_is_rejected(store, field, value):
    sid = session()
    taken = take(store, sid)
    rewrite_manifest(store, taken, lambda data: data.__setitem__(field, value))
    tenant = OTHER_TENANT if field == "tenant" else TENANT
    with pytest.raises(SnapshotRejectedError, match="HMAC does not match: it was altered"):
        store.load(sid, taken.snapshot_id, tenant)
    assert store.list(sid) == []


def test_an_altered_part_size_in_the_manifest_is_rejected(store):
    sid = session()
    taken = take(store, sid, data=b"abc")
    with open(store.part_path(taken, "files"), "ab") as handle:
        handle.write(b"more")  # the archive grew: make the manifest agree, as an attacker would
    rewrite_manifest(store, taken, lambda data: data["parts"]["files"].__setitem__("bytes", 7))
    with pytest.raises(SnapshotRejectedError, match="HMAC does not match"):
        store.load(sid, taken.snapshot_id, TENANT)


@pytest.mark.parametrize("change", ["flip", "drop", "not hex"])
def test_an_altered_or_missing_hmac_is_rejected(store, change):
    sid = session()
    taken = take(store, sid)

    def edit(data):
        if change == "flip":
            data["hmac"] = ("0" if data["hmac"][0] != "0" else "1") + data["hmac"][1:]
        elif change == "drop":
            del data["hmac"]
        else:
            data["hmac"] = "é" * 64  # compare_digest would raise on non-ASCII: refused before it

    rewrite_manifest(store, taken, edit)
    with pytest.raises(SnapshotRejectedError, match="HMAC"):
        store.load(sid, taken.snapshot_id, TENANT)


@pytest.mark.parametrize("content", [b"", b"{not json", b"[]", b'"\xff\xfe"', b"{}"])
def test_a_manifest_that_is_not_one_is_rejected(store, content):
    sid = session()
    taken = take(store, sid)
    (directory(store, taken) / MANIFEST).write_bytes(content)
    with pytest.raises(SnapshotRejectedError, match="refused"):
        store.load(sid, taken.snapshot_id, TENANT)


def test_an_oversized_manifest_is_refused_unread(store):
    sid = session()
    taken = take(store, sid)
    (directory(store, taken) / MANIFEST).write_bytes(b" " * (2 << 20))
    with pytest.raises(SnapshotRejectedError, match="under 1 MiB"):
        store.load(sid, taken.snapshot_id, TENANT)


@pytest.mark.parametrize("how", ["truncated", "grown", "missing"])
def test_a_part_of_another_size_is_rejected(store, how):
    sid = session()
    taken = take(store, sid, data=b"0123456789")
    part = store.part_path(taken, "files")
    if how == "truncated":
        os.truncate(part, 4)
    elif how == "grown":
        with open(part, "ab") as handle:
            handle.write(b"!")
    else:
        part.unlink()
    match = "cannot be opened" if how == "missing" else "not the 10 its manifest records"
    with pytest.raises(SnapshotRejectedError, match=match):
        store.load(sid, taken.snapshot_id, TENANT)


def test_part_content_of_the_same_size_is_not_checked_here(store):
    """The store checks sizes only; restore_files hashes the content against the signed sha256
    (tests/test_snapshot_archive.py), so it is read once, on the path that uses it."""
    sid = session()
    taken = take(store, sid, data=b"original")
    store.part_path(taken, "files").write_bytes(b"ORIGINAL")
    loaded = store.load(sid, taken.snapshot_id, TENANT)
    assert loaded.parts["files"].sha256 == hashlib.sha256(b"original").hexdigest()  # what restore checks against


# -- binding to tenant and session ----------------------------------------------------------------


def test_another_tenant_is_refused_without_learning_the_owner(store):
    sid = session()
    taken = take(store, sid, tenant="alice-secret-org")
    for tenant in (OTHER_TENANT, "", "alice-secret-or", "ALICE-SECRET-ORG"):
        with pytest.raises(SnapshotRejectedError, match="belongs to another tenant") as refused:
            store.load(sid, taken.snapshot_id, tenant)
        assert "alice" not in str(refused.value).lower()
    assert store.load(sid, taken.snapshot_id, "alice-secret-org") == taken


def test_a_snapshot_copied_into_another_session_is_refused(store):
    victim_session, thief_session = session(), session()
    taken = take(store, victim_session)
    take(store, thief_session)  # the thief's session has a snapshot dir of its own
    shutil.copytree(directory(store, taken), store.root / thief_session / taken.snapshot_id)
    with pytest.raises(SnapshotRejectedError, match="taken of another session") as refused:
        store.load(thief_session, taken.snapshot_id, TENANT)
    assert victim_session not in str(refused.value)
    assert taken.snapshot_id not in {m.snapshot_id for m in store.list(thief_session)}


def test_a_snapshot_of_another_session_is_not_found_under_this_one(store):
    sid = session()
    taken = take(store, sid)
    with pytest.raises(SnapshotRejectedError, match="does not exist"):
        store.load(session(), taken.snapshot_id, TENANT)


def test_a_manifest_renamed_to_another_snapshot_id_is_refused(store):
    sid = session()
    first, second = take(store, sid, data=b"first"), take(store, sid, data=b"second!")
    shutil.copy(directory(store, first) / MANIFEST, directory(store, second) / MANIFEST)
    with pytest.raises(SnapshotRejectedError, match="another session or snapshot"):
        store.load(sid, second.snapshot_id, TENANT)


# -- symlinks are never followed -----------------------------------------------------------------


def test_a_symlinked_session_dir_is_refused(store, tmp_path):
    sid, elsewhere = session(), session()
    taken = take(store, elsewhere)
    (store.root / sid).symlink_to(store.root / elsewhere)  # would resolve to a valid snapshot dir
    with pytest.raises(SnapshotRejectedError, match="symlink"):
        store.load(sid, taken.snapshot_id, TENANT)
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / sid).unlink()
    (store.root / sid).symlink_to(outside)
    with pytest.raises(SnapshotError, match="symlink"):
        store.draft(sid)
    assert os.listdir(outside) == []
    assert sid not in store.sessions()


def test_a_symlinked_snapshot_dir_is_refused(store):
    sid = session()
    real = take(store, sid)
    fake_id = "0123456789abcdef"
    (store.root / sid / fake_id).symlink_to(directory(store, real))
    with pytest.raises(SnapshotRejectedError, match="symlink"):
        store.load(sid, fake_id, TENANT)
    assert store.list(sid) == [real]


def test_a_symlinked_manifest_is_refused(store, tmp_path):
    sid = session()
    taken = take(store, sid)
    manifest = directory(store, taken) / MANIFEST
    copy = tmp_path / "copy.json"
    shutil.copy(manifest, copy)  # byte for byte the valid, signed manifest
    manifest.unlink()
    manifest.symlink_to(copy)
    with pytest.raises(SnapshotRejectedError, match="symlink"):
        store.load(sid, taken.snapshot_id, TENANT)


def test_a_symlinked_part_is_refused(store, tmp_path):
    sid = session()
    taken = take(store, sid, data=b"12345")
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"SECRT")  # the same size: only the link gives it away
    part = store.part_path(taken, "files")
    part.unlink()
    part.symlink_to(secret)
    with pytest.raises(SnapshotRejectedError, match="symlink"):
        store.load(sid, taken.snapshot_id, TENANT)


def test_commit_refuses_a_symlinked_part(store, tmp_path):
    sid = session()
    draft = store.draft(sid)
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"abc")
    os.chmod(secret, 0o644)
    draft.part_path("files").symlink_to(secret)
    with pytest.raises(SnapshotError, match="symlink"):
        store.commit(draft, manifest_for(draft, TENANT, b"abc"))
    assert not (draft.directory / MANIFEST).exists()
    assert mode(secret) == 0o644  # not "narrowed" through the link either


def test_commit_writes_into_the_checked_dir_even_if_it_is_swapped_meanwhile(store, tmp_path, monkeypatch):
    """The manifest goes through the descriptor of the directory that was checked: a directory
    renamed and replaced by a symlink between the check and the write changes nothing."""
    sid = session()
    draft = store.draft(sid)
    draft.part_path("files").write_bytes(b"abc")
    outside = tmp_path / "outside"
    outside.mkdir()
    moved = store.root / sid / "moved"
    check_part = store_module._check_part

    def check_then_swap(*args, **kwargs):
        check_part(*args, **kwargs)
        draft.directory.rename(moved)
        draft.directory.symlink_to(outside)

    monkeypatch.setattr(store_module, "_check_part", check_then_swap)
    store.commit(draft, manifest_for(draft, TENANT, b"abc"))
    assert os.listdir(outside) == []
    assert sorted(os.listdir(moved)) == ["files.part", MANIFEST]


def test_a_symlinked_root_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="not a directory owned by this user"):
        SnapshotStore(tmp_path / "link")
    assert os.listdir(real) == []


# -- commit and discard ---------------------------------------------------------------------------


def test_commit_refuses_a_part_of_another_size_and_writes_nothing(store):
    sid = session()
    draft = store.draft(sid)
    draft.part_path("files").write_bytes(b"abc")
    with pytest.raises(SnapshotError, match="has 3 bytes, not the 4"):
        store.commit(draft, manifest_for(draft, TENANT, b"abcd"))
    assert not (draft.directory / MANIFEST).exists()
    draft.part_path("files").unlink()
    with pytest.raises(SnapshotError, match="cannot be opened"):
        store.commit(draft, manifest_for(draft, TENANT, b"abc"))


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"kind": "snooze"}, "kind 'snooze' is not one of"),
        ({"kind": "cell", "cell": None}, "names the cell it follows"),
        ({"replay_from": 5}, "replay_from 5 is past the 3 cells"),
        ({"cells": -1}, "is not a count"),
        ({"created": float("nan")}, "Out of range float"),
        ({"profile": {"bad": object()}}, "not JSON serializable"),
        ({"tenant": None}, "tenant has the wrong type"),
    ],
)
def test_commit_refuses_an_invalid_manifest(store, fields, match):
    sid = session()
    draft = store.draft(sid)
    draft.part_path("files").write_bytes(b"abc")
    with pytest.raises(SnapshotError, match=match):
        store.commit(draft, manifest_for(draft, fields.pop("tenant", TENANT), b"abc", **fields))
    assert not (draft.directory / MANIFEST).exists()


def test_commit_refuses_another_drafts_manifest(store):
    sid = session()
    one, two = store.draft(sid), store.draft(sid)
    two.part_path("files").write_bytes(b"abc")
    with pytest.raises(SnapshotError, match="does not belong to draft"):
        store.commit(one, manifest_for(two, TENANT, b"abc"))
    foreign = store.draft(session())
    with pytest.raises(SnapshotError, match="does not belong to draft"):
        store.commit(foreign, manifest_for(SnapshotDraft(foreign.snapshot_id, foreign.directory, sid), TENANT, b""))


def test_discard_removes_the_draft_and_drafts_are_not_listed(store):
    sid = session()
    kept = take(store, sid)
    draft = store.draft(sid)
    draft.part_path("files").write_bytes(b"partial")
    assert store.list(sid) == [kept]  # a draft is not a snapshot
    with pytest.raises(SnapshotRejectedError, match="never completed"):
        store.load(sid, draft.snapshot_id, TENANT)
    store.discard(draft)
    assert not draft.directory.exists() and store.list(sid) == [kept]


# -- listing, usage, removal ----------------------------------------------------------------------


def test_list_is_oldest_first_and_skips_damaged_ones_with_a_log(store, caplog):
    sid = session()
    late = take(store, sid, created=2000.0)
    early = take(store, sid, created=1000.0)
    damaged = take(store, sid, created=1500.0)
    os.truncate(store.part_path(damaged, "files"), 1)
    with caplog.at_level(logging.WARNING, logger="sandkernel.kernels.snapshots.store"):
        assert store.list(sid) == [early, late]
    assert damaged.snapshot_id in caplog.text
    assert store.list(session()) == []  # a session without snapshots


def test_usage_is_counted_per_tenant(store):
    a1, a2, b = session(), session(), session()
    alice_one = take(store, a1, tenant="alice", data=b"x" * 1000)
    alice_two = take(store, a2, tenant="alice", data=b"y" * 500)
    bob_one = take(store, b, tenant="bob", data=b"z" * 300)
    alice = dir_bytes(store, alice_one) + dir_bytes(store, alice_two)
    bob = dir_bytes(store, bob_one)
    assert store.tenant_bytes("alice") == alice and alice > 1500
    assert store.tenant_bytes("bob") == bob and bob > 300
    assert store.tenant_bytes("carol") == 0
    draft = store.draft(a1)
    draft.part_path("files").write_bytes(b"d" * 200)  # a draft has no signed owner yet
    assert store.tenant_bytes("alice") == alice
    assert store.total_bytes() == alice + bob + 200  # the key is not a snapshot
    rewrite_manifest(store, alice_one, lambda data: data.__setitem__("tenant", "bob"))  # no longer signed
    assert store.tenant_bytes("bob") == bob  # an altered manifest is nobody's
    assert store.tenant_bytes("alice") == dir_bytes(store, alice_two)


def test_remove_one_then_all_returns_the_bytes_freed(store):
    sid = session()
    one = take(store, sid, data=b"a" * 100)
    two = take(store, sid, data=b"b" * 50)
    size_one, size_two = dir_bytes(store, one), dir_bytes(store, two)
    assert store.remove(sid, one.snapshot_id) == size_one and size_one > 100
    assert store.list(sid) == [two] and not directory(store, one).exists()
    assert store.remove(sid, one.snapshot_id) == 0  # already gone
    store.draft(sid).part_path("files").write_bytes(b"c" * 10)  # drafts go too
    assert store.remove(sid) == size_two + 10
    assert not (store.root / sid).exists() and store.sessions() == []
    assert store.remove(sid) == 0


def test_removing_the_last_snapshot_removes_the_session_dir(store):
    sid = session()
    only = take(store, sid)
    store.remove(sid, only.snapshot_id)
    assert store.sessions() == []


def test_remove_never_follows_a_symlink(store, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    sid = session()
    taken = take(store, sid)
    (directory(store, taken) / "link").symlink_to(victim)  # a link inside a snapshot dir
    store.remove(sid, taken.snapshot_id)
    linked = session()
    (store.root / linked).symlink_to(victim)  # a link in place of a session dir
    (victim / taken.snapshot_id).mkdir()  # named like a snapshot, behind the link
    (victim / taken.snapshot_id / "precious").write_text("keep too")
    assert store.remove(linked, taken.snapshot_id) == 0
    assert (victim / taken.snapshot_id / "precious").read_text() == "keep too"
    assert store.remove(linked) == 0
    assert (victim / "precious").read_text() == "keep" and not (store.root / linked).is_symlink()
    assert (victim / taken.snapshot_id / "precious").read_text() == "keep too"


def test_a_snapshot_taken_out_is_gone_at_once_and_its_files_deleted_later(store):
    sid = session()
    kept, used = take(store, sid, data=b"k" * 300), take(store, sid, data=b"u" * 500)
    before = store.tenant_bytes(TENANT)
    trash = store.take_out(sid, used.snapshot_id)
    assert trash is not None and trash.parent == store.root and trash.name.startswith(store_module.TRASH_PREFIX)
    assert store.list(sid) == [kept] and store.tenant_bytes(TENANT) == before - dir_bytes_at(trash)
    with pytest.raises(SnapshotRejectedError):
        store.load(sid, used.snapshot_id, TENANT)
    assert store.sessions() == [sid]  # its other snapshot keeps the session dir
    assert store.take_out(sid, used.snapshot_id) is None  # already out
    store.empty(trash)
    assert not trash.exists() and store.list(sid) == [kept]
    assert store.take_out(sid, kept.snapshot_id) is not None
    assert store.sessions() == []  # the last one out takes the session dir with it


def test_empty_deletes_nothing_it_did_not_take_out(store, tmp_path):
    sid = session()
    taken = take(store, sid)
    outside = tmp_path / f"{store_module.TRASH_PREFIX}{'0' * 16}"
    outside.mkdir()
    for wrong in (store.root / sid, directory(store, taken), outside, store.root / "removed-../x"):
        with pytest.raises(SnapshotError, match="not a snapshot taken out"):
            store.empty(wrong)
    assert store.list(sid) == [taken] and outside.is_dir()


def test_a_start_deletes_what_was_taken_out_and_not_yet_deleted(store, tmp_path):
    sid = session()
    first, second = take(store, sid), take(store, sid)
    out = [store.take_out(sid, first.snapshot_id), store.take_out(sid, second.snapshot_id)]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    (store.root / f"{store_module.TRASH_PREFIX}{'f' * 16}").symlink_to(victim)  # a link: never followed
    assert store.empty_all() == 2
    assert not any(path.exists() for path in out) and (victim / "precious").read_text() == "keep"


def test_take_out_never_follows_a_symlink(store, tmp_path):
    victim = tmp_path / "victim"
    sid = session()
    taken = take(store, sid)
    (victim / taken.snapshot_id).mkdir(parents=True)
    (victim / taken.snapshot_id / "precious").write_text("keep")
    shutil.rmtree(directory(store, taken))
    directory(store, taken).symlink_to(victim / taken.snapshot_id)  # a link in place of the snapshot dir
    assert store.take_out(sid, taken.snapshot_id) is None
    assert not directory(store, taken).is_symlink() and (victim / taken.snapshot_id / "precious").exists()
    linked = session()
    (store.root / linked).symlink_to(victim)  # a link in place of the session dir
    assert store.take_out(linked, taken.snapshot_id) is None
    assert (store.root / linked).is_symlink() and (victim / taken.snapshot_id / "precious").exists()


def test_total_bytes_counts_drafts_and_damaged_snapshots(store):
    sid = session()
    taken = take(store, sid, data=b"q" * 700)
    os.truncate(store.part_path(taken, "files"), 100)  # damaged: still on disk
    draft = store.draft(sid)
    draft.part_path("files").write_bytes(b"w" * 50)
    manifest = (directory(store, taken) / MANIFEST).stat().st_size
    assert store.total_bytes() == 100 + manifest + 50


# -- ids ------------------------------------------------------------------------------------------

BAD_IDS = ["../etc", "..", "", "ABCDEF0123456789", "abc/def", "a" * 65, "0123456789abcdeg", " 0123", None, 12]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_ids_that_are_not_hex_are_refused_before_naming_a_path(store, bad):
    sid = session()
    taken = take(store, sid)
    with pytest.raises(SnapshotRejectedError, match="is never used in a path"):
        store.load(bad, taken.snapshot_id, TENANT)
    with pytest.raises(SnapshotRejectedError, match="is never used in a path"):
        store.load(sid, bad, TENANT)
    for call in (lambda: store.draft(bad), lambda: store.list(bad), lambda: store.remove(bad)):
        with pytest.raises(SnapshotError, match="is never used in a path"):
            call()
    if bad is not None:  # None: all of the session's
        with pytest.raises(SnapshotError, match="is never used in a path"):
            store.remove(sid, bad)
    assert store.list(sid) == [taken] and store.sessions() == [sid]


@pytest.mark.parametrize("name", ["../files", "Files", "files.part", "", "a/b"])
def test_part_names_are_checked_too(store, name):
    draft = store.draft(session())
    with pytest.raises(SnapshotError, match="part name"):
        draft.part_path(name)


def test_uuid_session_ids_with_dashes_are_accepted(store):
    sid = str(uuid.uuid4())  # a Jupyter tool's kernel id
    taken = take(store, sid)
    assert store.load(sid, taken.snapshot_id, TENANT) == taken


def test_manifest_from_dict_refuses_junk():
    with pytest.raises(ValueError, match="JSON object"):
        SnapshotManifest.from_dict([])
    with pytest.raises(ValueError, match="missing or unknown"):
        SnapshotManifest.from_dict({"format": 1})
