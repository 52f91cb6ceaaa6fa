"""The host directory through which the host and a sandboxed kernel share ZMQ ipc sockets.

Transport with no network: the container has only loopback, and the kernel binds its five
ZMQ sockets as unix sockets in this directory, bind-mounted into the container. The danger
is that the directory is written by the container, and a hostile kernel could swap a socket
for a symlink to a host socket (docker.sock) for the host to connect to, leave entries or open
files behind, or fill the host's disk. The defence:

1. The directory is its own small tmpfs (:data:`TMPFS_OPTIONS`: a few MiB, a few dozen inodes)
   when the host runs as root, so nothing the kernel writes there, open handles to removed
   files included, can take more than that from the host.
2. It is writable by the kernel only during a start: :meth:`RuntimeDir.prepare` gives it to the
   sandbox group (root-owned, group ``gid``, mode 1770: never world-writable, and the sticky bit
   keeps the sandbox from renaming or replacing the files the host wrote).
3. Once the five sockets exist, :meth:`RuntimeDir.lock` makes it read-only to the kernel (mode
   0755, owned by the host user, and the kernel's uid differs), so no entry can be created,
   renamed or removed any more.
4. Only after the lock, the check the kernel can no longer race: each expected socket is
   ``lstat``-ed and must be a unix socket, not a symlink; the host's two files must be the
   ones it wrote; anything else (files, FIFOs, dirs, links made during the start window, for
   instance by a config file of the tenant's that IPython runs before it binds its sockets) is
   removed and the kernel refused. Any failure raises TransportError.

The parent directory is 0700 and owned by the host user, so other host users cannot reach
the sockets; the kernel needs no access to it because the bind mount names the child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from sandkernel.errors import ConfigError, TransportError
from sandkernel.kernels.sandbox.seccomp import seccomp_profile

log = logging.getLogger(__name__)

CONTAINER_DIR = "/run/sandkernel"
CONNECTION_FILE = "connection.json"
SECCOMP_FILE = "seccomp.json"
SOCKET_PREFIX = "k"
RUNTIME_DIR_NAME = "[0-9a-f]{12}"  # each kernel's dir under the base: secrets.token_hex(6)
PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
# AF_UNIX paths are limited to 108 bytes (sun_path) including the NUL.
MAX_SOCKET_PATH = 100
# Each runtime dir's own tmpfs: five sockets and two small JSON files need far less; this is
# what a hostile kernel can at most hold on the host through the dir (root hosts only).
TMPFS_OPTIONS = "size=2m,nr_inodes=64,mode=0700"
# Mode while the kernel starts (group = the sandbox's; sticky: only owners rename or remove an
# entry) and after the lock (read-only to everyone but the host user).
START_MODE = 0o1770
LOCKED_MODE = 0o755
MS_NOSUID, MS_NODEV, MS_NOEXEC, MNT_DETACH = 0x2, 0x4, 0x8, 0x2


def default_base_dir() -> Path:
    """Where per-kernel runtime dirs live: SANDKERNEL_RUNTIME_DIR, else /run/sandkernel for root,
    else $XDG_RUNTIME_DIR/sandkernel or /tmp/sandkernel-<uid>. Read at call time."""
    if os.environ.get("SANDKERNEL_RUNTIME_DIR"):
        return Path(os.environ["SANDKERNEL_RUNTIME_DIR"])
    if os.getuid() == 0:
        return Path("/run/sandkernel")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "sandkernel"
    return Path(tempfile.gettempdir()) / f"sandkernel-{os.getuid()}"


class RuntimeDir:
    """One kernel's socket directory on the host."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: dict[str, bytes] = {}  # what prepare() wrote, for lock() to verify

    @classmethod
    def create(cls, base: Path | None = None) -> RuntimeDir:
        """Make a fresh dir under ``base`` (0700 parent); on a root host, mount its own tmpfs."""
        base = base or default_base_dir()
        base.mkdir(parents=True, exist_ok=True)
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            # e.g. /tmp/sandkernel-<uid> made (or symlinked) by another user before us
            raise ConfigError(
                f"runtime base {base} is not a directory of this user's; remove it or set SANDKERNEL_RUNTIME_DIR"
            )
        os.chmod(base, 0o700)
        path = base / secrets.token_hex(6)
        if len(str(path / f"{SOCKET_PREFIX}-5")) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"runtime dir {base} is too deep for unix socket paths (limit {MAX_SOCKET_PATH} bytes); "
                "set SANDKERNEL_RUNTIME_DIR to a shorter path"
            )
        path.mkdir(mode=0o700)
        if os.geteuid() == 0:
            try:
                mount_tmpfs(path)
            except OSError:
                path.rmdir()
                raise
        else:
            log.warning("not root: runtime dir %s is not size-capped (no tmpfs of its own)", path)
        return cls(path)

    @property
    def egress_dir(self) -> Path:
        """Beside the runtime dir, never inside it: the kernel may only connect to the egress
        socket (read-only mount), never write where it lives."""
        return self.path.with_name(self.path.name + "-egress")

    @property
    def host_ip(self) -> str:
        """The ``ip`` of the host-side connection info (ipc paths are ``{ip}-{port}``)."""
        return str(self.path / SOCKET_PREFIX)

    def socket_paths(self) -> list[Path]:
        return [self.path / f"{SOCKET_PREFIX}-{port}" for port in PORTS.values()]

    def prepare(self, connection_info: dict, group: int | None = None) -> None:
        """Clear old entries, write the container-side connection file and the seccomp profile
        (the kernel installs it on itself, see kernel-image/start_kernel.py), then open the dir
        to ``group`` (the sandbox's gid; None keeps it to the host user, for host-only use).

        Called before every kernel (re)start, when no process of the sandbox is alive.
        The host's files from the previous start are kept when they are intact and unchanged:
        under gVisor, space a killed kernel filled can stay held (by the sandbox's cached host
        file handles) until the container goes, and the files must not need it back.
        Raises ConfigError when the host user may not hand the dir to that group.
        """
        os.chmod(self.path, 0o700)
        wanted = self._host_file_bytes(connection_info)
        kept = {
            n for n, data in wanted.items() if self._written.get(n) == data and self._is_host_file(self.path / n, data)
        }
        for entry in self.path.iterdir():
            if entry.name not in kept:
                remove_entry(entry)
        for name, data in wanted.items():
            if name in kept:
                continue
            fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(self.path / name, 0o644)
        self._written = wanted
        if group is not None:
            try:
                os.chown(self.path, -1, group)
            except PermissionError as err:
                raise ConfigError(
                    f"cannot give runtime dir {self.path} to the sandbox group {group}: run the gateway as "
                    f"root, or add its user to group {group}"
                ) from err
        os.chmod(self.path, START_MODE)

    @staticmethod
    def _host_file_bytes(connection_info: dict) -> dict[str, bytes]:
        """The exact bytes of the files the host writes for a kernel with this key."""
        info = {key: connection_info[key] for key in ("key", "signature_scheme")}
        info.update(PORTS, transport="ipc", ip=f"{CONTAINER_DIR}/{SOCKET_PREFIX}")
        return {name: json.dumps(content).encode() for name, content in host_files(info).items()}

    @classmethod
    def reattach(cls, path: Path, connection_info: dict) -> RuntimeDir:
        """The runtime dir of a kernel a previous process started (a gateway restart), checked
        as :meth:`lock` checks a fresh one: locked, exactly the five sockets (not symlinks) and
        the host's two files, byte for byte. Raises TransportError; an unexpected entry is
        reported, not removed (the sandbox is left alone for an operator to look at)."""
        runtime_dir = cls(path)
        runtime_dir._written = cls._host_file_bytes(connection_info)
        st = os.lstat(path)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != LOCKED_MODE:
            raise TransportError(f"runtime dir {path} is not locked as the host left it")
        expected = {p.name for p in runtime_dir.socket_paths()} | set(runtime_dir._written)
        extra = sorted(name for name in os.listdir(path) if name not in expected)
        if extra:
            raise TransportError(f"runtime dir {path} holds unexpected entries ({', '.join(extra)})")
        runtime_dir._verify_entries()
        return runtime_dir

    def sockets_ready(self) -> bool:
        """Whether the kernel has bound all five sockets (checked with lstat, never followed)."""
        return all(os.path.lexists(p) for p in self.socket_paths())

    def lock(self) -> None:
        """Make the dir read-only to the kernel, then verify every entry. Raises TransportError.

        Entries that are neither the five sockets nor the host's two files are removed before the
        refusal, so nothing the kernel left there outlives the attempt."""
        os.chmod(self.path, LOCKED_MODE)
        st = os.lstat(self.path)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
            raise TransportError(f"runtime dir {self.path} is not locked (owner {st.st_uid}); refusing to connect")
        expected = {p.name for p in self.socket_paths()} | set(self._written)
        extra = sorted(name for name in os.listdir(self.path) if name not in expected)
        for name in extra:
            remove_entry(self.path / name)
        if extra:
            raise TransportError(f"the kernel left unexpected entries in its runtime dir ({', '.join(extra)}); removed")
        self._verify_entries()

    def _verify_entries(self) -> None:
        """The host's files are the ones it wrote, and each socket is a socket (lstat only)."""
        for name, data in self._written.items():
            if not self._is_host_file(self.path / name, data):
                raise TransportError(f"{self.path / name} is not the file the host wrote; refusing to connect")
        for path in self.socket_paths():
            try:
                entry = os.lstat(path)
            except FileNotFoundError:
                raise TransportError(f"kernel socket {path} is missing; refusing to connect") from None
            if not stat.S_ISSOCK(entry.st_mode):
                kind = "a symlink" if stat.S_ISLNK(entry.st_mode) else "not a socket"
                raise TransportError(f"kernel socket {path} is {kind}; refusing to connect to it")

    @staticmethod
    def _is_host_file(path: Path, data: bytes) -> bool:
        """A regular file of the host user's, with no other name, holding exactly ``data``."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            ok = stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_nlink == 1
            return ok and f.read(len(data) + 1) == data

    def remove_sockets(self) -> None:
        """Remove the five socket files (a savable sandbox detached for a checkpoint). Under
        gVisor a host connect to a socket file whose listener the sandbox closed hangs rather
        than fails: every host ZMQ socket that reconnects meanwhile (the gateway's, each
        websocket's) would then wait out ZMQ's 30 s handshake interval. To a missing file it
        fails at once, and ZMQ tries again until the sandbox listens anew."""
        for path in self.socket_paths():
            if os.path.lexists(path):
                remove_entry(path)

    def remove(self) -> None:
        remove_runtime_dir(self.path)


def host_files(connection_info: dict) -> dict[str, dict]:
    """The files the host writes into a runtime dir (name -> JSON content)."""
    return {CONNECTION_FILE: connection_info, SECCOMP_FILE: seccomp_profile()}


def remove_runtime_dir(path: Path) -> None:
    """Unmount (if it is a mount point), then delete a runtime dir and its egress sibling."""
    if os.path.ismount(path):
        umount(path)
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path.with_name(path.name + "-egress"), ignore_errors=True)


def remove_entry(path: Path) -> None:
    """Remove one entry without following it (a directory's tree too); errors are left to the
    caller's next check, which then finds the entry still there."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError as err:
        log.warning("cannot remove %s from a runtime dir: %s", path, err)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount_tmpfs(path: Path) -> None:
    """Mount a small tmpfs of its own at ``path`` (root only; see :data:`TMPFS_OPTIONS`)."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc().mount(b"sandkernel", os.fsencode(path), b"tmpfs", flags, TMPFS_OPTIONS.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount a tmpfs at {path}: {os.strerror(err)}")


def umount(path: Path) -> None:
    """Detach the mount at ``path`` (lazily: a container still holding it does not block us)."""
    if _libc().umount2(os.fsencode(path), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        log.warning("cannot unmount %s: %s", path, os.strerror(err))
