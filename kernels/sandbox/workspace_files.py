"""Workspace files, read and written inside the sandbox (never by the host following a path).

Each operation is a short ``/opt/kernel/bin/python -I`` run by ``docker exec`` as the sandbox
user: the path is resolved inside the container, so a symlink the code planted can at worst point
at something the sandbox user could read anyway, and nothing on the host is ever touched. The
interpreter is named by absolute path (a planted ``/workspace/.local/bin/python`` is never looked
up) and ``-I`` ignores PYTHONPATH and user site, so a planted module cannot stand in for the helper.
Only regular files are read or replaced (O_NOFOLLOW, O_NONBLOCK: no devices, FIFOs, symlinks).

Paths: a relative one is in /workspace and must stay there (no ``..`` or symlink out of it); an
absolute one may be anywhere the sandbox's user can read or write (/workspace, /tmp, a new
directory under either): the helper runs as that user, so the kernel's own permission checks
decide, as they do for the session's code (refusals: ``permission_denied``, ``not_found``,
``is_directory``, ``not_regular``, ``too_large``, ``bad_path``).

Uploads replace the file atomically (a new temp file of a random name beside it, then rename), but
not with :mod:`sandkernel.atomic`, the host's writer: this code runs inside the container, where
sandkernel is not installed and must not be (the kernel could then import and patch it), and the
host must never open a path the sandboxed code controls. That holds for a disk workspace too
(workspace_disk.py): its image is mounted on the host, but the host never opens tenant files by
path through that mount point, where a planted symlink could lead it to a host file (per-cell
accounting's scan reads it fd-relative with O_NOFOLLOW at every step: workspace_scan.py). No fsync: ext4
flushes a file replaced by rename before the rename commits (auto_da_alloc), and a memory
workspace dies with the container anyway.
"""

from __future__ import annotations

import json

import docker.errors

from sandkernel.errors import ConfigError, HelperKilledError, KernelNotFoundError, SandkernelError
from sandkernel.kernels.sandbox.container import SANDBOX_PYTHON, WORKSPACE, HelperLane, SandboxContainer
from sandkernel.kernels.sandbox.exec_stream import FILE_HELPER_TIMEOUT, SIGKILL_EXIT

MAX_FILE_BYTES = 32 * 1024 * 1024
MAX_LISTING = 10000
# Bounds of a helper's output: a listing's JSON per entry (a 255-character name escaped as
# \uXXXX is 1.5 KiB), and what an error's message adds to a file's bytes.
LISTING_ENTRY_BYTES = 2048
MESSAGE_BYTES = 64 * 1024

# Runs inside the sandbox. argv: op, path, max_bytes. Exit 0 with the result on stdout, or 2
# with {"error": code, "message": sentence} on stdout.
_HELPER = r"""
import base64, errno, json, os, stat, sys
op, rel, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
root = "/workspace"
def fail(code, message):
    sys.stdout.write(json.dumps({"error": code, "message": message})); sys.exit(2)
def refused(err, what):
    if isinstance(err, PermissionError) or err.errno == errno.EROFS:
        fail("permission_denied", f"{what}: permission denied ({err.strerror})")
if "\x00" in rel:
    fail("bad_path", "path contains a NUL byte")
if rel.startswith("/"):  # anywhere the sandbox user may go: its own permissions decide
    path = "/" + os.path.normpath(rel).lstrip("/")
    shown = os.path.relpath(path, root) if path.startswith(root + "/") else path  # one name per file
else:  # relative: inside /workspace, and no symlink out of it
    path = os.path.normpath(os.path.join(root, rel))
    shown = os.path.relpath(path, root)
    if path != root and not path.startswith(root + "/"):
        fail("bad_path", f"{rel!r} is outside the workspace (give an absolute path for another place)")
    parent = os.path.realpath(os.path.dirname(path)) if path != root else root
    if parent != root and not parent.startswith(root + "/"):
        fail("bad_path", f"{rel!r} goes through a symlink out of the workspace")
if op == "list":
    try:
        entries = []
        with os.scandir(path) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink")]
                kind = next((name for test, name in kinds if test(st.st_mode)), "other")
                entries.append({"name": e.name, "type": kind, "size": st.st_size, "modified": st.st_mtime})
                if len(entries) >= limit: break
    except FileNotFoundError:
        fail("not_found", f"no directory {rel!r}")
    except NotADirectoryError:
        fail("not_a_directory", f"{rel!r} is not a directory")
    except OSError as err:
        refused(err, f"cannot list {rel!r}")
        fail("bad_path", f"cannot list {rel!r} ({err.strerror})")
    sys.stdout.write(json.dumps(sorted(entries, key=lambda e: e["name"])))
elif op == "read":
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        fail("not_found", f"no file {rel!r}")
    except OSError as err:
        refused(err, f"cannot read {rel!r}")
        fail("not_regular", f"{rel!r} cannot be read as a regular file ({err.strerror})")
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        fail("is_directory", f"{rel!r} is a directory")
    if not stat.S_ISREG(st.st_mode):
        fail("not_regular", f"{rel!r} is not a regular file")
    if st.st_size > limit:
        fail("too_large", f"{rel!r} is {st.st_size} bytes; the limit is {limit}")
    with os.fdopen(fd, "rb") as f:
        sys.stdout.buffer.write(f.read(limit + 1)[:limit])
elif op == "write":
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        fail("too_large", f"upload is over the limit of {limit} bytes")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as err:
        refused(err, f"cannot make the directory of {rel!r}")
        fail("bad_path", f"cannot make the directory of {rel!r} ({err.strerror})")
    if os.path.isdir(path) and not os.path.islink(path):
        fail("is_directory", f"{rel!r} is a directory")
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.urandom(6).hex()}.sandkernel-upload")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        refused(err, f"cannot write {rel!r}")
        fail("not_regular", f"cannot write {rel!r} ({err.strerror})")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(tmp); fail("not_regular", f"{rel!r} exists and is not a regular file")
        os.replace(tmp, path)
    except OSError as err:
        try: os.unlink(tmp)
        except OSError: pass
        refused(err, f"cannot write {rel!r}")
        fail("no_space" if err.errno in (28, 122) else "not_written", f"cannot write {rel!r} ({err.strerror})")
    sys.stdout.write(json.dumps({"path": shown, "size": len(data)}))
"""


class WorkspaceFiles:
    """Upload, download and list files in one session's sandbox (relative paths: in /workspace)."""

    def __init__(self, container: SandboxContainer, timeout: float = FILE_HELPER_TIMEOUT) -> None:
        self.container = container
        self.timeout = timeout  # seconds each operation may take in the sandbox (then 504)

    async def list(self, path: str = "") -> list[dict]:
        out = await self._run("list", path, MAX_LISTING)
        return json.loads(out)

    async def read(self, path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
        return await self._run("read", path, max_bytes)

    async def write(self, path: str, data: bytes, max_bytes: int = MAX_FILE_BYTES) -> dict:
        if not path or path.endswith("/"):
            raise ConfigError("give a file path, e.g. 'data/sales.csv' (in /workspace) or '/tmp/data/sales.csv'")
        return json.loads(await self._run("write", path, max_bytes, stdin=data))

    async def _run(self, op: str, path: str, limit: int, stdin: bytes | None = None) -> bytes:
        if not isinstance(path, str):
            raise ConfigError("path must be a string")
        argv = [SANDBOX_PYTHON, "-I", "-c", _HELPER, op, path, str(limit)]
        try:
            code, stdout, stderr = await self.container.run_helper(
                argv,
                self.timeout,
                what=f"the workspace {op} helper",
                lane=HelperLane.FILES,
                stdin=stdin,
                workdir=WORKSPACE,
                max_output=limit * LISTING_ENTRY_BYTES if op == "list" else limit + MESSAGE_BYTES,
            )
        except docker.errors.APIError as err:
            raise KernelNotFoundError(f"the session's container is not available: {err.explanation}") from err
        if code == 2:
            problem = json.loads(stdout)
            raise WorkspaceFileError(problem["error"], problem["message"])
        if code == SIGKILL_EXIT:
            raise HelperKilledError(
                f"the workspace {op} helper was killed in the sandbox before it answered: the session's code stops or "
                "kills new processes (the gateway kills a helper stopped before it runs), or its memory is full"
            )
        if code != 0:
            raise SandkernelError(f"workspace {op} failed in the sandbox: {stderr.decode(errors='replace')[-300:]}")
        return stdout


class WorkspaceFileError(ConfigError):
    """A file request the sandbox refused: ``code`` is not_found, bad_path, not_regular, too_large..."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
