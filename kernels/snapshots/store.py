"""Where snapshots live on the host: one directory each, a signed manifest, the archive beside it.

Layout: ``state_dir("snapshots")/<session id>/<snapshot id>/`` holds ``manifest.json`` and one
file per part (``files.part``: the tar that kernels/snapshots/archive.py made inside the sandbox).
A snapshot directory without a manifest is a draft: being written, or left by a crash.

Snapshots are tenants' data, so every choice here is about who can read or alter them:

- **0700 directories, 0600 files, ours only.** The root comes from ``state_dir`` (made 0700,
  checked to be this user's); session and snapshot directories are made 0700, the manifest
  and the key 0600, and a part left wider than 0600 is narrowed at commit.
- **Nothing below the root is followed.** Every directory is opened relative to its parent's
  descriptor with ``O_NOFOLLOW | O_DIRECTORY`` and every file with ``O_NOFOLLOW``, so a symlink
  planted as a session dir, a snapshot dir, the manifest, a part or the key is refused, never
  read or written through. The manifest is written through the descriptor of the directory that
  was checked (``/proc/self/fd``), so swapping the directory meanwhile changes nothing.
- **Ids are checked before they name a path.** A session id is lowercase hex and dashes (as
  workspace disks take it), a snapshot id 16 lowercase hex digits, a part name a short
  lowercase word: nothing that can climb out of its directory.
- **A manifest is signed and bound.** ``manifest.json`` carries an HMAC-SHA256, keyed with
  ``snapshot.key`` (32 random bytes, made once, 0600), over the canonical JSON of the manifest
  without its ``hmac`` field (sorted keys, compact separators), compared in constant time. The
  signed fields name the session and the tenant, and :meth:`SnapshotStore.load` refuses a
  manifest of another session or tenant: a snapshot copied into another session's directory,
  or asked for by another tenant, is never restored. The HMAC is over the *parsed* manifest, so
  what is verified is exactly what is used (duplicate JSON keys cannot smuggle a second value).
- **Sizes here, contents in the archive.** Load checks that each part has the size the signed
  manifest records; the part's sha256 (also signed) is checked by ``restore_files`` while it
  reads the part, so the content is hashed once, on the path that uses it.

Every method blocks on disk: the gateway calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandkernel.atomic import write_atomic
from sandkernel.errors import ConfigError, SnapshotError, SnapshotRejectedError
from sandkernel.kernels.sandbox.sparse_files import allocated
from sandkernel.kernels.sandbox.state_dir import state_dir
from sandkernel.kernels.sandbox.workspace_disk import SESSION_ID
from sandkernel.kernels.snapshots.archive import ArchivePart

log = logging.getLogger(__name__)

SNAPSHOTS = "snapshots"  # state_dir(SNAPSHOTS): 0700, the operator's only
KEY_FILE = "snapshot.key"
KEY_BYTES = 32
STORE_ID_TEXT = b"sandkernel snapshot store"  # what store_id signs
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1  # the layout of manifest.json; a newer one is refused, not guessed at
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KB (the profile is the biggest field)
PART_SUFFIX = ".part"
KINDS = frozenset({"pause", "fork", "cell"})
SNAPSHOT_ID = re.compile(r"[0-9a-f]{16}")  # secrets.token_hex(8)
PART_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
HMAC_HEX = re.compile(r"[0-9a-f]{64}")
TRASH_PREFIX = "removed-"  # a snapshot taken out of the store (SnapshotStore.take_out), being deleted
TRASH_NAME = re.compile(re.escape(TRASH_PREFIX) + r"[0-9a-f]{16}")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_FIELDS = ("snapshot_id", "session_id", "tenant", "kind", "created", "profile", "cells", "replay_from", "cell")


@dataclasses.dataclass
class SnapshotManifest:
    """What a snapshot is: whose, of which session, when, how far to replay, and its parts.

    ``cells`` counts the transcript's code cells when it was taken; code cells before
    ``replay_from`` are not replayed (the kernel's memory was lost before them); ``cell`` is the
    code cell a ``"cell"`` snapshot follows. ``profile`` and ``extra`` are opaque JSON here."""

    snapshot_id: str
    session_id: str
    tenant: str
    kind: str
    created: float
    profile: dict[str, Any]
    cells: int
    replay_from: int
    cell: int | None
    parts: dict[str, ArchivePart]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """The size of its parts (what the manifest signs; the manifest itself is not counted)."""
        return sum(part.bytes for part in self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON of the manifest (without the HMAC, which :class:`SnapshotStore` adds)."""
        data: dict[str, Any] = {"format": MANIFEST_FORMAT}
        data.update({name: getattr(self, name) for name in _FIELDS})
        data["parts"] = {name: part.to_dict() for name, part in self.parts.items()}
        data["extra"] = self.extra
        return data

    @classmethod
    def from_dict(cls, data: Any) -> SnapshotManifest:
        """The manifest in ``data``, every field checked; ValueError naming the first bad one."""
        if not isinstance(data, dict):
            raise ValueError("a manifest is a JSON object")
        expected = {"format", *_FIELDS, "parts", "extra"}
        if set(data) != expected:
            raise ValueError(f"fields {sorted(set(data) ^ expected)} missing or unknown")
        if data["format"] != MANIFEST_FORMAT:
            raise ValueError(f"format {data['format']!r}; this sandkernel reads format {MANIFEST_FORMAT}")
        manifest = cls(
            snapshot_id=_match(SNAPSHOT_ID, data["snapshot_id"], "snapshot_id"),
            session_id=_match(SESSION_ID, data["session_id"], "session_id"),
            tenant=_typed(data["tenant"], str, "tenant"),
            kind=_typed(data["kind"], str, "kind"),
            created=float(_typed(data["created"], (int, float), "created")),
            profile=_typed(data["profile"], dict, "profile"),
            cells=_count(data["cells"], "cells"),
            replay_from=_count(data["replay_from"], "replay_from"),
            cell=None if data["cell"] is None else _count(data["cell"], "cell"),
            parts=_parts(data["parts"]),
            extra=_typed(data["extra"], dict, "extra"),
        )
        manifest.check()
        return manifest

    def check(self) -> None:
        """ValueError unless the fields agree with each other (kind, cell counts, a finite time)."""
        if self.kind not in KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {sorted(KINDS)}")
        if not math.isfinite(self.created):
            raise ValueError("created is not a finite time")
        if self.replay_from > self.cells:
            raise ValueError(f"replay_from {self.replay_from} is past the {self.cells} cells")
        if self.kind == "cell" and self.cell is None:
            raise ValueError('a "cell" snapshot names the cell it follows')


@dataclasses.dataclass(frozen=True)
class SnapshotDraft:
    """A snapshot being written: its directory exists (0700), its manifest not yet."""

    snapshot_id: str
    directory: Path
    session_id: str

    def part_path(self, name: str) -> Path:
        """Where the part ``name`` goes (the host chooses the file name, never the sandbox)."""
        return self.directory / _part_file(name)


class SnapshotStore:
    """Snapshot directories under one root; see the module docstring for why it is built so."""

    def __init__(self, root: Path | None = None) -> None:
        """Open the store at ``root`` (default ``state_dir("snapshots")``), making the key once.

        Raises ConfigError when the root or the key is not ours (a symlink, another user's, a key
        of the wrong size): the operator must look, because snapshots signed with a replaced key
        would all be refused."""
        self.root = _prepare_root(root)
        with self._root_fd() as root_fd:
            self._key = _load_or_make_key(root_fd, self.root / KEY_FILE)

    @property
    def store_id(self) -> str:
        """What tells two stores apart without showing their key: an HMAC of a fixed text under
        the key. Gateways whose stores have the same id read the same snapshots (one directory
        on shared storage: the key is in it), so each can resume what another paused; the
        cluster catalog compares them (gateway/cluster/takeover.py)."""
        return hmac.new(self._key, STORE_ID_TEXT, hashlib.sha256).hexdigest()[:32]

    # -- writing -------------------------------------------------------------------------------

    def draft(self, session_id: str) -> SnapshotDraft:
        """A new, empty snapshot directory of ``session_id`` for the parts to be written into."""
        _check_id(SESSION_ID, session_id, "session id", SnapshotError)
        snapshot_id = secrets.token_hex(8)
        with self._root_fd() as root_fd:
            with contextlib.suppress(FileExistsError):
                os.mkdir(session_id, 0o700, dir_fd=root_fd)
            with _open_dir(root_fd, session_id, _session_where(session_id), SnapshotError) as session_fd:
                os.mkdir(snapshot_id, 0o700, dir_fd=session_fd)
        return SnapshotDraft(snapshot_id, self.root / session_id / snapshot_id, session_id)

    def commit(self, draft: SnapshotDraft, manifest: SnapshotManifest) -> SnapshotManifest:
        """Sign ``manifest`` and write it into the draft's directory, which makes it a snapshot.

        Raises SnapshotError (nothing written) when the manifest is not the draft's or not
        valid, or a part is missing, not a regular file, or not the size the manifest records."""
        if (manifest.snapshot_id, manifest.session_id) != (draft.snapshot_id, draft.session_id):
            raise SnapshotError(
                f"manifest of snapshot {manifest.snapshot_id} (session {manifest.session_id}) does not belong to "
                f"draft {draft.snapshot_id} (session {draft.session_id}); commit each draft with its own manifest"
            )
        where = _where(draft.session_id, draft.snapshot_id)
        try:
            # Signed as the reader will see it: JSON round trip (tuples become lists), the reader's checks.
            data = json.loads(json.dumps(manifest.to_dict(), allow_nan=False))
            SnapshotManifest.from_dict(data)
            signed = {**data, "hmac": self._mac(data)}
        except (ValueError, TypeError) as err:
            raise SnapshotError(f"{where}: its manifest is invalid ({err}); nothing was written") from err
        with self._snapshot_fd(draft.session_id, draft.snapshot_id, SnapshotError) as fd:
            for name, part in manifest.parts.items():
                _check_part(fd, where, name, part, SnapshotError, narrow=True)
            text = json.dumps(signed, sort_keys=True, indent=1, allow_nan=False) + "\n"
            try:
                # Through the checked directory's descriptor: the manifest lands in that directory.
                write_atomic(f"/proc/self/fd/{fd}/{MANIFEST}", text, make_parents=False)
            except OSError as err:
                log.error("writing the manifest of %s failed: %s", where, err)
                raise SnapshotError(f"{where}: writing its manifest failed ({err.strerror or err})") from err
        log.info("snapshot committed", extra={"session": draft.session_id, "snapshot": draft.snapshot_id})
        return manifest

    def write_part(self, draft: SnapshotDraft, name: str, data: bytes) -> ArchivePart:
        """Write a part the gateway made itself (not an archive from the sandbox: the session's
        transcript) into the draft, 0600, never through a link; its size and SHA-256 for the
        manifest."""
        _check_id(PART_NAME, name, "part name", SnapshotError)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with self._snapshot_fd(draft.session_id, draft.snapshot_id, SnapshotError) as fd:
            part_fd = os.open(_part_file(name), flags, 0o600, dir_fd=fd)
            with os.fdopen(part_fd, "wb") as handle:
                handle.write(data)
        return ArchivePart(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

    def read_part(self, manifest: SnapshotManifest, name: str) -> bytes:
        """The whole part ``name`` of a loaded snapshot, checked against the size and SHA-256 its
        signed manifest records (SnapshotRejectedError otherwise). For the small parts the
        gateway wrote (:meth:`write_part`); archives are streamed by restore_files instead."""
        part = manifest.parts.get(name)
        where = _where(manifest.session_id, manifest.snapshot_id)
        if part is None:
            raise SnapshotRejectedError(f"{where} has no part {name!r}; it was taken by an older sandkernel")
        with self._snapshot_fd(manifest.session_id, manifest.snapshot_id, SnapshotRejectedError) as fd:
            _check_part(fd, where, name, part, SnapshotRejectedError)
            part_fd = os.open(_part_file(name), _READ_FLAGS, dir_fd=fd)
            try:
                data = _read_all(part_fd, part.bytes + 1)
            finally:
                os.close(part_fd)
        if len(data) != part.bytes or not hmac.compare_digest(hashlib.sha256(data).hexdigest(), part.sha256):
            raise SnapshotRejectedError(f"{where}: its part {name!r} does not match its manifest (altered); not used")
        return data

    def discard(self, draft: SnapshotDraft) -> None:
        """Remove a draft and whatever was written into it (a failed capture, or a commit the
        caller gave up on: the caller's view that the snapshot failed wins)."""
        self._remove(draft.session_id, draft.snapshot_id)

    # -- reading -------------------------------------------------------------------------------

    def load(self, session_id: str, snapshot_id: str, tenant: str) -> SnapshotManifest:
        """The verified manifest of one snapshot, for ``tenant``'s session ``session_id``.

        Raises SnapshotRejectedError, and touches nothing, when an id is not hex, the snapshot is
        missing or unreadable, its HMAC does not match (altered, or signed with another key), it
        was taken of another session or belongs to another tenant (the message never names the
        owner), or a part is missing or not its recorded size."""
        _check_id(SESSION_ID, session_id, "session id", SnapshotRejectedError)
        _check_id(SNAPSHOT_ID, snapshot_id, "snapshot id", SnapshotRejectedError)
        with self._snapshot_fd(session_id, snapshot_id, SnapshotRejectedError) as fd:
            manifest = self._read_signed(fd, session_id, snapshot_id)
            if not hmac.compare_digest(
                manifest.tenant.encode(errors="surrogatepass"), tenant.encode(errors="surrogatepass")
            ):
                raise SnapshotRejectedError(
                    f"snapshot {snapshot_id} of session {session_id} belongs to another tenant; "
                    "it is never restored into another tenant's session"
                )
            for name, part in manifest.parts.items():
                _check_part(fd, _where(session_id, snapshot_id), name, part, SnapshotRejectedError)
        return manifest

    def part_path(self, manifest: SnapshotManifest, name: str) -> Path:
        """Where the part ``name`` of a loaded snapshot is (KeyError when it has none of that name)."""
        if name not in manifest.parts:
            raise KeyError(f"snapshot {manifest.snapshot_id} has no part {name!r} (it has {sorted(manifest.parts)})")
        _check_id(SESSION_ID, manifest.session_id, "session id", SnapshotError)
        _check_id(SNAPSHOT_ID, manifest.snapshot_id, "snapshot id", SnapshotError)
        return self.root / manifest.session_id / manifest.snapshot_id / _part_file(name)

    def list(self, session_id: str) -> list[SnapshotManifest]:
        """The session's snapshots that pass :meth:`load`'s checks (tenant aside), oldest first.

        A damaged one is skipped and logged (it stays on disk for the operator; :meth:`remove`
        frees it); drafts (no manifest yet) are skipped quietly."""
        _check_id(SESSION_ID, session_id, "session id", SnapshotError)
        found = []
        for snapshot_id in self._snapshot_ids(session_id):
            try:
                with self._snapshot_fd(session_id, snapshot_id, SnapshotRejectedError) as fd:
                    manifest = self._read_signed(fd, session_id, snapshot_id)
                    for name, part in manifest.parts.items():
                        _check_part(fd, _where(session_id, snapshot_id), name, part, SnapshotRejectedError)
            except _Draft:
                continue
            except SnapshotRejectedError as err:
                if os.path.lexists(self.root / session_id / snapshot_id):  # else: removed meanwhile
                    log.warning(
                        "damaged snapshot skipped: %s", err, extra={"session": session_id, "snapshot": snapshot_id}
                    )
                continue
            found.append(manifest)
        return sorted(found, key=lambda m: (m.created, m.snapshot_id))

    def sessions(self) -> list[str]:
        """Session ids that have a snapshot directory (real directories only), for sweeping orphans."""
        with os.scandir(self.root) as entries:
            return sorted(e.name for e in entries if SESSION_ID.fullmatch(e.name) and e.is_dir(follow_symlinks=False))

    # -- disk use and removal ------------------------------------------------------------------

    def remove(self, session_id: str, snapshot_id: str | None = None) -> int:
        """Delete one snapshot, or (``snapshot_id`` None) all of the session's, drafts included;
        returns the bytes freed. A symlink in their place is unlinked, never followed."""
        _check_id(SESSION_ID, session_id, "session id", SnapshotError)
        if snapshot_id is not None:
            _check_id(SNAPSHOT_ID, snapshot_id, "snapshot id", SnapshotError)
        return self._remove(session_id, snapshot_id)

    def take_out(self, session_id: str, snapshot_id: str) -> Path | None:
        """Take one snapshot out of the store at once, to be deleted later: its directory renamed
        into the root as ``TRASH_PREFIX<random>`` (delete it with :meth:`empty`; a start's
        :meth:`empty_all` deletes what a crash left), the session's directory removed if that
        left it empty. None when there is no such snapshot (a link in its place is unlinked).

        Why: deleting a 200 MB session's snapshot took 0.11 s of each resume and fork here, the
        caller waiting; nothing reads a snapshot once a resume or a fork is done with it, and
        what is out no longer counts against the tenant's quota (:meth:`tenant_bytes`)."""
        _check_id(SESSION_ID, session_id, "session id", SnapshotError)
        _check_id(SNAPSHOT_ID, snapshot_id, "snapshot id", SnapshotError)
        session_dir = self.root / session_id
        for level in (session_dir, session_dir / snapshot_id):
            try:
                st = os.lstat(level)
            except FileNotFoundError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                log.warning("%s is not a directory: unlinked if it is the target, never followed", level)
                if level != session_dir:
                    level.unlink()
                return None
        trash = self.root / f"{TRASH_PREFIX}{secrets.token_hex(8)}"
        try:
            os.rename(session_dir / snapshot_id, trash)
        except FileNotFoundError:  # taken out meanwhile
            return None
        with contextlib.suppress(OSError):  # not empty: other snapshots, or a draft being written
            os.rmdir(session_dir)
        return trash

    def empty(self, trash: Path) -> None:
        """Delete a snapshot :meth:`take_out` took out (never anything else: a name of its making,
        in the root)."""
        if trash.parent != self.root or not TRASH_NAME.fullmatch(trash.name):
            raise SnapshotError(f"{trash} is not a snapshot taken out of this store")
        freed = _tree_bytes(trash)
        shutil.rmtree(trash, ignore_errors=True)  # fd-based on Linux: links inside are removed, never followed
        log.info("snapshot deleted", extra={"bytes": freed})

    def empty_all(self) -> int:
        """Delete every snapshot taken out and not yet deleted (a start's sweep: a stop or a crash
        came first); how many."""
        with os.scandir(self.root) as entries:
            found = [Path(e.path) for e in entries if TRASH_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        for trash in found:
            shutil.rmtree(trash, ignore_errors=True)
        return len(found)

    def tenant_bytes(self, tenant: str) -> int:
        """Disk used by ``tenant``'s snapshots: every file of each snapshot whose signed manifest
        names the tenant (one with a damaged part still counts: it still takes the disk)."""
        used = 0
        for session_id in self.sessions():
            for snapshot_id in self._snapshot_ids(session_id):
                try:
                    with self._snapshot_fd(session_id, snapshot_id, SnapshotRejectedError) as fd:
                        owner = self._read_signed(fd, session_id, snapshot_id).tenant
                except (_Draft, SnapshotRejectedError):
                    continue
                if owner == tenant:
                    used += _tree_bytes(self.root / session_id / snapshot_id)
        return used

    def disk_bytes(self, manifest: SnapshotManifest) -> int:
        """Disk used by one snapshot's files: less than :attr:`SnapshotManifest.bytes` where a
        part is sparse (a workspace disk kept whole is as large as the workspace, holes and all)."""
        return _tree_bytes(self.root / manifest.session_id / manifest.snapshot_id)

    def total_bytes(self) -> int:
        """Disk used by all snapshots, drafts and damaged ones included."""
        return sum(_tree_bytes(self.root / session_id) for session_id in self.sessions())

    # -- plumbing ------------------------------------------------------------------------------

    def _mac(self, data: dict[str, Any]) -> str:
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        return hmac.new(self._key, canonical.encode(), hashlib.sha256).hexdigest()

    @contextlib.contextmanager
    def _root_fd(self) -> Iterator[int]:
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _snapshot_fd(self, session_id: str, snapshot_id: str, error: type[SnapshotError]) -> Iterator[int]:
        """The descriptor of root/session/snapshot, each step opened without following a link."""
        what = _where(session_id, snapshot_id)
        with (
            self._root_fd() as root_fd,
            _open_dir(root_fd, session_id, _session_where(session_id), error) as session_fd,
            _open_dir(session_fd, snapshot_id, what, error) as fd,
        ):
            yield fd

    def _snapshot_ids(self, session_id: str) -> list[str]:
        try:
            with (
                self._root_fd() as root_fd,
                _open_dir(root_fd, session_id, _session_where(session_id), SnapshotError) as fd,
            ):
                names = os.listdir(fd)
        except SnapshotError:
            if not os.path.lexists(self.root / session_id):  # never made, or removed meanwhile
                return []
            raise
        return [name for name in names if SNAPSHOT_ID.fullmatch(name)]

    def _read_signed(self, fd: int, session_id: str, snapshot_id: str) -> SnapshotManifest:
        """The manifest in the snapshot directory ``fd``, its HMAC checked, bound to the ids its
        directory is named by. Raises _Draft when there is no manifest, SnapshotRejectedError
        for anything else wrong with it."""
        where = _where(session_id, snapshot_id)
        try:
            manifest_fd = os.open(MANIFEST, _READ_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            raise _Draft(f"{where} has no manifest: it was never completed; take a new snapshot") from None
        except OSError as err:
            raise SnapshotRejectedError(
                f"{where}: its manifest cannot be opened ({_why(err)}); it is not used"
            ) from err
        try:
            st = os.fstat(manifest_fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_MANIFEST_BYTES:
                raise SnapshotRejectedError(f"{where}: its manifest is not a regular file of the gateway's under 1 MiB")
            raw = _read_all(manifest_fd, MAX_MANIFEST_BYTES)
        finally:
            os.close(manifest_fd)
        try:
            data = json.loads(raw)
            stored = data.pop("hmac", None) if isinstance(data, dict) else None
            if not isinstance(stored, str) or not HMAC_HEX.fullmatch(stored):
                raise ValueError("it carries no HMAC")
            if not hmac.compare_digest(self._mac(data), stored):
                raise ValueError("its HMAC does not match: it was altered, or signed with another snapshot key")
            manifest = SnapshotManifest.from_dict(data)
        except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
            raise SnapshotRejectedError(f"{where} is refused: {err}; it is never restored") from None
        if manifest.snapshot_id != snapshot_id or manifest.session_id != session_id:
            raise SnapshotRejectedError(
                f"{where} is refused: its manifest was taken of another session or snapshot; "
                "a snapshot is only restored into the session it was taken of"
            )
        return manifest

    def _remove(self, session_id: str, snapshot_id: str | None) -> int:
        """Each level is lstat-checked before anything below it is named: a symlink in place of
        the session dir is unlinked (all of the session's) or left alone (one snapshot), never
        walked through. (Only this user can change the 0700 root between check and removal.)"""
        target = self.root / session_id
        for level in (target,) if snapshot_id is None else (target, target / snapshot_id):
            try:
                st = os.lstat(level)
            except FileNotFoundError:
                return 0
            if not stat.S_ISDIR(st.st_mode):
                log.warning("%s is not a directory: unlinked if it is the target, never followed", level)
                if snapshot_id is None or level != target:
                    level.unlink()
                return 0
        if snapshot_id is not None:
            target = target / snapshot_id
        freed = _tree_bytes(target)
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile
            shutil.rmtree(target)  # fd-based on Linux: links inside are removed, never followed
        if snapshot_id is not None:
            with contextlib.suppress(OSError):  # not empty: other snapshots, or a draft being written
                os.rmdir(self.root / session_id)
        log.info("snapshots removed", extra={"session": session_id, "snapshot": snapshot_id, "bytes": freed})
        return freed


class _Draft(SnapshotRejectedError):
    """A snapshot directory with no manifest (being written, or left by a crash): refused by
    load like any unusable snapshot, skipped quietly by list."""


def _prepare_root(root: Path | None) -> Path:
    """``state_dir("snapshots")``, or ``root`` made and checked the same way (0700, ours, no link)."""
    if root is None:
        return state_dir(SNAPSHOTS)
    root = Path(root).absolute()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(f"snapshot dir {root} is not a directory owned by this user (a symlink?); fix or move it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(root, 0o700)
    return root


def _load_or_make_key(root_fd: int, path: Path) -> bytes:
    """The store's HMAC key: read when it exists, else made once. It is written whole to a temp
    file and then linked into place, so two processes starting together agree on one key and
    neither reads half of one; an existing key is never replaced (every snapshot signed with it
    would be refused)."""
    refuse = (
        f"the snapshot key {path} is {{}}; nothing was changed: fix or remove it "
        "(the snapshots signed with it are then refused)"
    )
    try:
        fd = os.open(KEY_FILE, _READ_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        _make_key(root_fd)
        fd = os.open(KEY_FILE, _READ_FLAGS, dir_fd=root_fd)
    except OSError as err:
        raise ConfigError(refuse.format(f"unusable ({_why(err)})")) from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(refuse.format("not a regular file owned by this user"))
        if stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("snapshot key %s was readable by others; narrowed to 0600", path)
            os.fchmod(fd, 0o600)
        key = _read_all(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise ConfigError(refuse.format(f"{len(key)} bytes long, not {KEY_BYTES}"))
    return key


def _make_key(root_fd: int) -> None:
    tmp = f".{KEY_FILE}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: use that one
            os.link(tmp, KEY_FILE, src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False)
            os.fsync(root_fd)
    finally:
        os.unlink(tmp, dir_fd=root_fd)


@contextlib.contextmanager
def _open_dir(parent_fd: int, name: str, what: str, error: type[SnapshotError]) -> Iterator[int]:
    """``name`` under ``parent_fd`` opened as a directory of ours, never through a symlink.
    ``what`` names it in messages (no host path: they may reach the tenant)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError as err:
        raise error(f"{what} does not exist (removed, or never taken)") from err
    except OSError as err:
        why = _why(err)
        with contextlib.suppress(OSError):  # O_DIRECTORY reports a link to a directory as ENOTDIR
            if stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                why = "it is a symlink"
        raise error(f"{what} is refused: {why}; it is never followed or used") from err
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise error(f"{what} is refused: its directory is not the gateway's")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        yield fd
    finally:
        os.close(fd)


def _check_part(
    fd: int, where: str, name: str, part: ArchivePart, error: type[SnapshotError], *, narrow: bool = False
) -> None:
    """The part file ``name`` in the snapshot directory ``fd`` is a regular file of ours of the
    recorded size (its content is hashed by restore_files, which reads it anyway)."""
    try:
        part_fd = os.open(_part_file(name), _READ_FLAGS, dir_fd=fd)
    except OSError as err:
        raise error(f"{where}: its part {name!r} cannot be opened ({_why(err)}); the snapshot is not used") from err
    try:
        st = os.fstat(part_fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise error(f"{where}: its part {name!r} is not a regular file of the gateway's; the snapshot is not used")
        if st.st_size != part.bytes:
            raise error(
                f"{where}: its part {name!r} has {st.st_size} bytes, not the {part.bytes} its manifest records "
                "(truncated or altered); the snapshot is not used"
            )
        if narrow and stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(part_fd, 0o600)
    finally:
        os.close(part_fd)


def _tree_bytes(path: Path) -> int:
    """What the regular files under ``path`` take on disk: each one's size, or its allocated
    blocks where fewer (a sparse workspace disk image or memory image takes what its data does);
    symlinks are counted as nothing and never followed; 0 for a path that is gone."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += _tree_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += allocated(entry.stat(follow_symlinks=False))
        except FileNotFoundError:
            continue
    return total


def _where(session_id: str, snapshot_id: str) -> str:
    return f"snapshot {snapshot_id} of session {session_id}"


def _session_where(session_id: str) -> str:
    return f"the snapshot directory of session {session_id}"


def _read_all(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(65536, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _part_file(name: str) -> str:
    _check_id(PART_NAME, name, "part name", SnapshotError)
    return f"{name}{PART_SUFFIX}"


def _check_id(pattern: re.Pattern[str], value: Any, what: str, error: type[SnapshotError]) -> str:
    """``value`` when it matches ``pattern`` whole, else ``error``: it is about to name a path."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise error(f"{what} {repr(value)[:80]} is not valid (lowercase hex); it is never used in a path")
    return value


def _why(err: OSError) -> str:
    if err.errno == errno.ELOOP:
        return "it is a symlink"
    if err.errno == errno.ENOTDIR:
        return "it is not a directory"
    return err.strerror or str(err)


def _match(pattern: re.Pattern[str], value: Any, name: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{name} {repr(value)[:80]} is not valid")
    return value


def _typed(value: Any, kind: type | tuple[type, ...], name: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name} has the wrong type ({type(value).__name__})")
    return value


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} {value!r} is not a count")
    return value


def _parts(value: Any) -> dict[str, ArchivePart]:
    if not isinstance(value, dict):
        raise ValueError("parts is not an object")
    parts = {}
    for name, part in value.items():
        _match(PART_NAME, name, "part name")
        parts[name] = ArchivePart.from_dict(part)
    return parts
