"""The host directory through which the host and a sandboxed kernel share ZMQ ipc sockets.

Transport with no network: the container has only loopback, and the kernel binds its five
ZMQ sockets as unix sockets in this directory, bind-mounted into the container. The danger
is that the directory is written by the container, and a hostile kernel could swap a socket
for a symlink to a host socket (docker.sock) for the host to connect to. The defence:

1. The directory is writable by the kernel only until its sockets are bound: no user code
   runs before then (the host sends nothing until it has connected).
2. Then :meth:`RuntimeDir.lock` makes it read-only to the kernel (mode 0755, owned by the
   host user, and the kernel's uid differs), so no entry can be created, renamed or removed.
3. Only after the lock, each expected entry is ``lstat``-ed and must be a unix socket, not a
   symlink: a check the kernel can no longer race. Anything else raises TransportError.

The parent directory is 0700 and owned by the host user, so other host users cannot reach
the sockets; the kernel needs no access to it because the bind mount names the child.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from sandkernel.errors import ConfigError, TransportError
from sandkernel.kernels.seccomp import seccomp_profile

CONTAINER_DIR = "/run/sandkernel"
CONNECTION_FILE = "connection.json"
SECCOMP_FILE = "seccomp.json"
SOCKET_PREFIX = "k"
PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
# AF_UNIX paths are limited to 108 bytes (sun_path) including the NUL.
MAX_SOCKET_PATH = 100


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

    @classmethod
    def create(cls, base: Path | None = None) -> RuntimeDir:
        base = base or default_base_dir()
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        path = base / secrets.token_hex(6)
        if len(str(path / f"{SOCKET_PREFIX}-5")) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"runtime dir {base} is too deep for unix socket paths (limit {MAX_SOCKET_PATH} bytes); "
                "set SANDKERNEL_RUNTIME_DIR to a shorter path"
            )
        path.mkdir(mode=0o700)
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

    def prepare(self, connection_info: dict) -> None:
        """Clear old sockets, write the container-side connection file and the seccomp profile
        (the kernel installs it on itself, see kernel-image/start_kernel.py), open the dir.

        Called before every kernel (re)start, when no process of the sandbox is alive.
        """
        for entry in self.path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        info = {key: connection_info[key] for key in ("key", "signature_scheme")}
        info.update(PORTS, transport="ipc", ip=f"{CONTAINER_DIR}/{SOCKET_PREFIX}")
        for name, content in ((CONNECTION_FILE, info), (SECCOMP_FILE, seccomp_profile())):
            target = self.path / name
            target.write_text(json.dumps(content))
            os.chmod(target, 0o644)
        os.chmod(self.path, 0o777)

    def sockets_ready(self) -> bool:
        """Whether the kernel has bound all five sockets (checked with lstat, never followed)."""
        return all(os.path.lexists(p) for p in self.socket_paths())

    def lock(self) -> None:
        """Make the dir read-only to the kernel, then verify every socket. Raises TransportError."""
        os.chmod(self.path, 0o755)
        st = os.lstat(self.path)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
            raise TransportError(f"runtime dir {self.path} is not locked (owner {st.st_uid}); refusing to connect")
        for path in self.socket_paths():
            entry = os.lstat(path)
            if not stat.S_ISSOCK(entry.st_mode):
                kind = "a symlink" if stat.S_ISLNK(entry.st_mode) else "not a socket"
                raise TransportError(f"kernel socket {path} is {kind}; refusing to connect to it")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.egress_dir, ignore_errors=True)
