"""PID 1 of a savable sandbox (gVisor memory snapshots): starts the kernel and relays its sockets.

Why it exists: gVisor cannot checkpoint a sandbox while one of its processes holds a host unix
socket, and its restore kills every process that a ``docker exec`` started (runsc's
boot/restore.go: exec'd processes "cannot be properly restored"). So in a savable sandbox the
kernel descends from PID 1 and binds its five ZMQ sockets in a directory of the sandbox's own
(PRIVATE_DIR, on its /tmp, which the checkpoint carries), and this process joins each of them to
the host runtime dir's socket of the same name. Before a checkpoint it lets go of every host
socket; after a restore it gives the kernel its new key and listens again. The host's ZMQ
sockets reconnect by themselves.

Signals, sent by the host as ``kill -SIG 1`` (as the sandbox user):
  SIGUSR1  (re)start: kill the kernel (the host's restart has killed the rest), start a fresh
           one, and attach once it has bound its five sockets.
  SIGUSR2  detach: close the host listeners and every relayed connection (before a checkpoint),
           then make DETACHED_FILE (the host's signal helper waits for it).
  SIGHUP   attach: have the kernel take the key in the host's connection file (a restored or
           forked copy gets a fresh one), then listen on the host sockets again.
Being PID 1 it survives the restart's ``kill -KILL -1`` and reaps orphans. gVisor does not shield
an init from its own namespace's signals as Linux does, so the entrypoint starts it with every
other catchable signal ignored (the host's signals before READY_FILE exists are lost: it waits).
It runs as the sandbox user and holds nothing the tenant's code lacks; it is not dumpable, so that code cannot write its
memory through /proc either. The host tells a live kernel from a dead one by connecting to the
heartbeat socket: a live kernel's ZMQ greets it, a dead one's connection is closed at once (the
kernel's own socket refuses the relay); the exit code is in EXIT_FILE.
"""

import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import sys

HOST_DIR = "/run/sandkernel"  # the host runtime dir (runtime_dir.CONTAINER_DIR)
HOST_CONNECTION_FILE = f"{HOST_DIR}/connection.json"
PRIVATE_DIR = "/tmp/.sandkernel"  # the kernel's own sockets and the files below
PRIVATE_CONNECTION_FILE = f"{PRIVATE_DIR}/connection.json"
KEY_ACK_FILE = f"{PRIVATE_DIR}/key-ack"  # the kernel writes the SHA-256 of the key it took
EXIT_FILE = f"{PRIVATE_DIR}/exit-code"
READY_FILE = f"{PRIVATE_DIR}/ready"  # made once the signal handlers are in place
DETACHED_FILE = f"{PRIVATE_DIR}/detached"  # made once a detach has closed every host socket
REKEY_SIGNAL = signal.SIGUSR2  # to the kernel: read the host connection file's key (start_kernel.py)
SOCKETS = ("k-1", "k-2", "k-3", "k-4", "k-5")
LAUNCHER = "/opt/sandkernel/launch-kernel"
BIND_TIMEOUT = 120.0  # seconds for the kernel to bind its sockets (the host has its own deadline)
ACK_TIMEOUT = 10.0  # seconds for the kernel to take a new key
PR_SET_DUMPABLE = 4


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


def spawn_kernel() -> int:
    """Clear the private dir, write the kernel's connection file (the host's key, private
    sockets) and start the launcher: the kernel's pid (the launcher execs into it)."""
    os.makedirs(PRIVATE_DIR, mode=0o700, exist_ok=True)
    for entry in set(os.listdir(PRIVATE_DIR)) - {os.path.basename(READY_FILE), os.path.basename(DETACHED_FILE)}:
        with contextlib.suppress(OSError):
            os.unlink(f"{PRIVATE_DIR}/{entry}")
    with open(HOST_CONNECTION_FILE) as f:
        info = json.load(f)
    info.update(transport="ipc", ip=f"{PRIVATE_DIR}/k")
    with open(PRIVATE_CONNECTION_FILE, "w") as f:
        json.dump(info, f)
    argv = [LAUNCHER, PRIVATE_CONNECTION_FILE, f"{HOST_DIR}/seccomp.json"]
    # fork, not posix_spawn: glibc's spawn tries clone3, which gVisor's copy of the container's
    # seccomp profile answers EPERM (not ENOSYS), so it never falls back to clone.
    pid = os.fork()
    if pid == 0:  # the child: every signal's default back (the entrypoint ignored them for us)
        try:  # and an empty mask: an interrupt is the kernel's SIGINT, its children expect SIGPIPE
            for signum in set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}:
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            os.execv(LAUNCHER, argv)
        finally:
            os._exit(127)
    return pid


def kernel_sockets_bound() -> bool:
    """Whether the kernel listens on all five private sockets. A socket file exists from its
    bind, a moment before its listen: a host probe relayed in that moment was refused, and the
    host took the refusal for a dead kernel (a loaded rehearsal's start failed so)."""
    return all(_listening(f"{PRIVATE_DIR}/{name}") for name in SOCKETS)


def _listening(path: str) -> bool:
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def host_key() -> str:
    with open(HOST_CONNECTION_FILE) as f:
        return json.load(f)["key"]


def key_acknowledged(digest: str) -> bool:
    try:
        with open(KEY_ACK_FILE) as f:
            return f.read().strip() == digest
    except OSError:
        return False


def mark_ready() -> None:
    os.makedirs(PRIVATE_DIR, mode=0o700, exist_ok=True)
    touch(READY_FILE)


def touch(path: str) -> None:
    with open(path, "w"):
        pass


class Supervisor:
    def __init__(self) -> None:
        self.kernel: int | None = None  # the kernel's pid (launch-kernel execs into it)
        self.servers: list[asyncio.AbstractServer] = []
        self.writers: set[asyncio.StreamWriter] = set()
        self.work: asyncio.Task | None = None  # the start or attach in progress

    # -- relay -------------------------------------------------------------------------------

    async def attach(self) -> None:
        """Listen on the host sockets; each connection is joined to the kernel's own socket."""
        await self.detach()
        old_umask = os.umask(0)  # the host (another uid) connects
        try:
            for name in SOCKETS:
                path = f"{HOST_DIR}/{name}"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self.servers.append(await asyncio.start_unix_server(self._joiner(name), path))
        finally:
            os.umask(old_umask)

    def _joiner(self, name: str):  # type: ignore[no-untyped-def]
        async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_unix_connection(f"{PRIVATE_DIR}/{name}")
            except OSError:
                writer.close()
                return
            self.writers.update((writer, up_writer))
            try:
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            finally:
                self.writers.difference_update((writer, up_writer))

        return join

    async def detach_and_say_so(self) -> None:
        await self.detach()
        touch(DETACHED_FILE)

    async def detach(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(DETACHED_FILE)
        for server in self.servers:
            server.close()
        for writer in list(self.writers):
            writer.close()
        self.writers.clear()
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self.servers.clear()

    # -- kernel ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start a kernel on private sockets (killing the last one), attach when they exist."""
        await self.detach()
        if self.kernel is not None:  # the host's restart has killed the rest (`kill -KILL -1`)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.kernel, signal.SIGKILL)
        self.kernel = None  # the old kernel's end is reaped as nobody's, even if the spawn fails
        self.kernel = spawn_kernel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BIND_TIMEOUT
        while not kernel_sockets_bound():
            if self.kernel is None or loop.time() > deadline:
                return
            await asyncio.sleep(0.01)
        await self.attach()

    async def rekey_and_attach(self) -> None:
        """Have the kernel take the host connection file's key, then attach."""
        await self.detach()
        if self.kernel is None:
            return
        wanted = key_digest(host_key())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(KEY_ACK_FILE)
        os.kill(self.kernel, REKEY_SIGNAL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACK_TIMEOUT
        while not key_acknowledged(wanted):
            if self.kernel is None or loop.time() > deadline:
                return  # not attached: the host's wait for the sockets fails with the reason
            await asyncio.sleep(0.01)
        await self.attach()

    def reap(self) -> None:
        """Collect every exited child. The kernel's end keeps the listeners: each connection then
        ends at once (the host's liveness probe reads that as a dead kernel)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.kernel:
                self.kernel = None
                with contextlib.suppress(OSError), open(EXIT_FILE, "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))

    def run_alone(self, work) -> None:  # type: ignore[no-untyped-def]
        """One start or attach at a time: a new request replaces the one in progress."""
        if self.work is not None:
            self.work.cancel()
        self.work = asyncio.get_running_loop().create_task(work())


async def main() -> None:
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    supervisor = Supervisor()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, supervisor.run_alone, supervisor.start)
    loop.add_signal_handler(signal.SIGHUP, supervisor.run_alone, supervisor.rekey_and_attach)
    loop.add_signal_handler(signal.SIGUSR2, supervisor.run_alone, supervisor.detach_and_say_so)
    loop.add_signal_handler(signal.SIGCHLD, supervisor.reap)
    mark_ready()
    print("kernel supervisor ready", file=sys.stderr, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
