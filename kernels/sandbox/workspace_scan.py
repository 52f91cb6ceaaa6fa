"""What a cell did to /workspace, seen from the host: files created, modified, deleted, packages.

The workspace disk is mounted on the host (workspace_disk.py) and written by the sandbox, so
everything in it is hostile: names are arbitrary bytes, a directory can hold a million entries,
and a file or directory can be swapped for a symlink to a host path, or for a FIFO, between
two system calls of ours. The rules that keep a scan from ever reading outside the workspace:

- Every open is relative to the fd of a directory already opened (``dir_fd``), one name at a
  time, with ``O_NOFOLLOW``: a symlink at any step fails the open (ELOOP) instead of being
  followed. Directories are opened with ``O_DIRECTORY`` too, so a name swapped for a FIFO or
  device node is refused by the kernel before anything is opened (``os.fwalk`` is not used: it
  re-opens subdirectories without ``O_NOFOLLOW`` and only checks afterwards that it got the
  directory it meant, so a swapped-in symlink to a host device would still be opened once).
- An opened directory is walked only when its fstat matches the lstat taken while listing.
- Files are hashed through ``O_RDONLY | O_NOFOLLOW | O_NONBLOCK`` (a FIFO neither blocks nor is
  read) and only when fstat says regular; a file that changes while hashed gets no hash.
- Symlinks are listed as entries of type ``link``: never followed, their targets never read.
- Everything is bounded: entries per snapshot, directory depth, files and bytes hashed per cell,
  time spent hashing, entries listed in the result. Hitting a bound is said in a note.

Blocking throughout: call from a worker thread (kernels/execution/accounting.py does).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# Not user files: pip's prefix (reported as packages instead), caches, IPython's history.
EXCLUDED = frozenset({".local", ".cache", ".ipython"})
MAX_ENTRIES = 20_000  # entries looked at per snapshot
MAX_DEPTH = 64  # directory levels below /workspace
MAX_HASHED_FILES = 100  # per cell
MAX_HASHED_BYTES = 256 * 1024 * 1024  # per cell
MAX_HASH_SECONDS = 10.0  # per cell: a slow disk must not hold the result for long
MAX_LISTED = 1_000  # created + modified + deleted entries in one cell's result
MAX_PACKAGES = 10_000  # site-packages entries looked at
_CHUNK = 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIST_INFO = re.compile(r"([A-Za-z0-9_.]+)-([^-]+)\.dist-info")
_SITE_PACKAGES = re.compile(r"python3(\.[0-9]+)?")


class Entry(NamedTuple):
    """One path's state: what is compared between the snapshots before and after a cell (a
    tuple, not a dataclass: a snapshot makes one per entry, and this is the cheap kind)."""

    kind: str  # file | link | dir | other
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int


_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link"}


@dataclass
class Snapshot:
    """Path (``/``-joined, relative to the workspace) -> :class:`Entry`, plus what was left out."""

    entries: dict[str, Entry] = field(default_factory=dict)
    truncated: bool = False  # MAX_ENTRIES reached: the rest of the tree was not looked at
    too_deep: bool = False  # directories below MAX_DEPTH were not walked
    packages: frozenset[str] | None = None  # "name==version" of .local's site-packages


def display_path(path: str) -> str:
    """A path for JSON: names that are not UTF-8 keep their bytes as ``\\xNN`` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _open_root(root: Path) -> int:
    return os.open(root, _DIR_FLAGS)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def snapshot(root: Path, max_entries: int = MAX_ENTRIES, max_depth: int = MAX_DEPTH) -> Snapshot:
    """The state of every entry under ``root`` (the workspace's host mount), walked fd-relative
    without following a symlink (see the module docstring). Top-level :data:`EXCLUDED` names
    are skipped; ``.local`` is read for :attr:`Snapshot.packages`. Raises OSError only when
    ``root`` itself cannot be opened as a directory."""
    snap = Snapshot()
    fd = _open_root(root)
    try:
        _walk(fd, "", 0, snap, max_entries, max_depth)
        snap.packages = _packages(fd)
    finally:
        os.close(fd)
    return snap


def _walk(dir_fd: int, prefix: str, depth: int, snap: Snapshot, max_entries: int, max_depth: int) -> None:
    entries = snap.entries
    room = max_entries - len(entries)
    names: list[str] = []
    with os.scandir(dir_fd) as it:
        for dirent in it:
            if depth == 0 and dirent.name in EXCLUDED:
                continue
            if len(names) >= room:
                snap.truncated = True
                break
            names.append(dirent.name)
    lstat, kinds = os.lstat, _KINDS
    for name in names:
        try:
            st = lstat(name, dir_fd=dir_fd)
        except OSError:
            continue  # gone since it was listed
        kind = kinds.get(stat.S_IFMT(st.st_mode), "other")
        entries[prefix + name] = Entry(kind, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if kind != "dir" or snap.truncated:
            continue
        if depth + 1 >= max_depth:
            snap.too_deep = True
            continue
        try:
            child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            continue  # swapped for a symlink or something else since the lstat: not walked
        try:
            if _same(os.fstat(child), st):
                _walk(child, prefix + name + "/", depth + 1, snap, max_entries, max_depth)
        finally:
            os.close(child)


def _open_dir_at(dir_fd: int, name: str) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None


def _listdir(dir_fd: int, limit: int) -> list[str]:
    names = []
    with os.scandir(dir_fd) as it:
        for dirent in it:
            if len(names) >= limit:
                break
            names.append(dirent.name)
    return names


def _packages(root_fd: int) -> frozenset[str]:
    """``name==version`` of every ``*.dist-info`` in ``.local/lib/python3*/site-packages``
    (pip's prefix in the sandbox), read fd-relative like the walk; empty when there is none."""
    found: set[str] = set()
    fds: list[int] = []
    try:
        local = _open_dir_at(root_fd, ".local")
        if local is None:
            return frozenset()
        fds.append(local)
        lib = _open_dir_at(local, "lib")
        if lib is None:
            return frozenset()
        fds.append(lib)
        for version_dir in _listdir(lib, 16):
            if not _SITE_PACKAGES.fullmatch(version_dir):
                continue
            python = _open_dir_at(lib, version_dir)
            if python is None:
                continue
            fds.append(python)
            site = _open_dir_at(python, "site-packages")
            if site is None:
                continue
            fds.append(site)
            for name in _listdir(site, MAX_PACKAGES):
                match = _DIST_INFO.fullmatch(name)
                if match:
                    found.add(f"{match.group(1)}=={match.group(2)}")
    finally:
        for fd in fds:
            os.close(fd)
    return frozenset(found)


# -- one cell's changes -------------------------------------------------------------------


@dataclass
class _Budget:
    files: int = MAX_HASHED_FILES
    bytes: int = MAX_HASHED_BYTES
    deadline: float = 0.0


def _open_file(root_fd: int, path: str) -> int | None:
    """Open ``path`` under the root fd one component at a time, never following a symlink;
    None unless it is a regular file now."""
    parts = path.split("/")
    dir_fd, opened = root_fd, []
    try:
        for part in parts[:-1]:
            dir_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            opened.append(dir_fd)
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        for fd_ in opened:
            os.close(fd_)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _hash(root_fd: int, path: str, budget: _Budget) -> tuple[int | None, str | None]:
    """(size, sha256) of the regular file at ``path``; sha256 None when over the budget, gone,
    not a regular file any more, or changed while being read."""
    fd = _open_file(root_fd, path)
    if fd is None:
        return None, None
    try:
        before = os.fstat(fd)
        size = before.st_size
        if budget.files <= 0 or size > budget.bytes or time.monotonic() > budget.deadline:
            return size, None
        budget.files -= 1
        budget.bytes -= size
        digest, remaining = hashlib.sha256(), size
        while remaining > 0:
            chunk = os.read(fd, min(_CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
        after = os.fstat(fd)
        if remaining or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            return size, None  # written to while we read: no hash is better than a wrong one
        return size, digest.hexdigest()
    except OSError:
        return None, None
    finally:
        os.close(fd)


def _changed(before: Entry, after: Entry) -> bool:
    if after.kind == "dir" and before.kind == "dir":
        return False  # a directory's own times change with its entries: those are listed instead
    return before != after


def diff(
    root: Path,
    before: Snapshot,
    after: Snapshot,
    *,
    max_hashed_files: int = MAX_HASHED_FILES,
    max_hashed_bytes: int = MAX_HASHED_BYTES,
    max_hash_seconds: float = MAX_HASH_SECONDS,
    max_listed: int = MAX_LISTED,
) -> tuple[dict[str, Any], list[str]]:
    """The ``files`` part of a cell's accounting, and notes for what was left out.

    ``{"created": [{"path", "size", "sha256"}], "modified": [...], "deleted": [{"path"}],
    "hashed": n, "unhashed": n, "omitted": n}``. Regular files created or modified are hashed
    in path order within the budgets; over one, a file is listed with ``sha256`` None and counted
    in ``unhashed``. Non-regular entries carry ``"type": "link" | "other"`` (never hashed, never
    followed); directories are not listed. ``omitted`` counts entries past ``max_listed``."""
    notes = _coverage_notes(before, after)
    created = sorted(p for p in after.entries.keys() - before.entries.keys() if after.entries[p].kind != "dir")
    modified = sorted(
        p for p in after.entries.keys() & before.entries.keys() if _changed(before.entries[p], after.entries[p])
    )
    deleted = sorted(p for p in before.entries.keys() - after.entries.keys() if before.entries[p].kind != "dir")
    if after.truncated:
        deleted = []  # not seen after is not the same as deleted
    budget = _Budget(max_hashed_files, max_hashed_bytes, time.monotonic() + max_hash_seconds)
    result: dict[str, Any] = {"created": [], "modified": [], "deleted": [], "hashed": 0, "unhashed": 0, "omitted": 0}
    listed = 0
    fd = _open_root(root)
    try:
        for key, paths in (("created", created), ("modified", modified)):
            for path in paths:
                if listed >= max_listed:
                    result["omitted"] += 1
                    continue
                listed += 1
                entry = after.entries[path]
                item: dict[str, Any] = {"path": display_path(path), "size": entry.size, "sha256": None}
                if entry.kind == "file":
                    size, digest = _hash(fd, path, budget)
                    item["size"] = entry.size if size is None else size
                    item["sha256"] = digest
                    result["hashed" if digest else "unhashed"] += 1
                else:
                    item["type"] = entry.kind
                result[key].append(item)
    finally:
        os.close(fd)
    for path in deleted:
        if listed >= max_listed:
            result["omitted"] += 1
            continue
        listed += 1
        result["deleted"].append({"path": display_path(path)})
    if result["unhashed"]:
        notes.append(
            f"{result['unhashed']} changed files were not hashed (at most {max_hashed_files} files and "
            f"{max_hashed_bytes // (1024 * 1024)} MiB are hashed per cell; a file written while hashed gets none)"
        )
    if result["omitted"]:
        notes.append(f"{result['omitted']} more changed entries are not listed (at most {max_listed} per cell)")
    return result, notes


def _coverage_notes(before: Snapshot, after: Snapshot) -> list[str]:
    """What the comparison of ``before`` with ``after`` could not look at."""
    notes = []
    if before.truncated or after.truncated:
        notes.append(
            f"the workspace holds more than {MAX_ENTRIES} entries: only the first {MAX_ENTRIES} were compared, "
            "changes to the others are not listed"
        )
    if before.too_deep or after.too_deep:
        notes.append(f"directories more than {MAX_DEPTH} levels deep were not scanned")
    return notes


def unchanged(snap: Snapshot) -> tuple[dict[str, Any], list[str]]:
    """What :func:`diff` says of a workspace known not to have changed since ``snap`` (a
    fanotify watch saw nothing): no entries, the same notes, and no disk access at all."""
    empty = {"created": [], "modified": [], "deleted": [], "hashed": 0, "unhashed": 0, "omitted": 0}
    return empty, _coverage_notes(snap, snap)


def package_changes(before: Snapshot, after: Snapshot) -> dict[str, list[str]] | None:
    """``{"installed": [...], "removed": [...]}`` of ``name==version`` (an upgrade is both);
    None when either snapshot could not read them."""
    if before.packages is None or after.packages is None:
        return None
    return {"installed": sorted(after.packages - before.packages), "removed": sorted(before.packages - after.packages)}
