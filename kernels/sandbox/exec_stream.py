"""A ``docker exec`` in a sandbox, read and written within a deadline, and killed at it.

docker-py reads an exec's output with the socket's timeout turned off, so a helper that the
sandbox's own code stops (tenant code runs as the same user and can SIGSTOP every new process)
held the reading worker thread for good, and every later call waiting for a worker thread with
it: one tenant stopped the gateway for all. Every exec the host starts in a sandbox (the files
API, signals, the restart's kill, the snapshot archive and fingerprint) reads through here: the
attach socket gets an idle timeout, every read checks a wall-clock deadline and a stop flag (set
when the awaiting task was cancelled), and a helper given up on is killed when its process can
be shown to be this container's (:func:`kill_exec`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import requests.exceptions

from sandkernel.errors import SandkernelError
from sandkernel.kernels.sandbox.cgroup import kill_stopped_runc_inits

CHUNK = 1024 * 1024  # bytes read from the socket at most per call
log = logging.getLogger(__name__)

IDLE_TIMEOUT = 60.0  # seconds without a byte moving before a stream is given up

EXIT_GRACE = 10.0  # seconds Docker may take to record an exec's exit after its stream ended
# Seconds one file operation (list, download, upload) may take inside the sandbox by default (the
# largest upload, 32 MiB, takes well under one; the gateway's --helper-timeout): a helper the
# sandbox's code stopped is given up then, and the call fails with 504.
FILE_HELPER_TIMEOUT = 60.0


# Seconds dockerd may take to know a started exec's pid.
PID_GRACE = 5.0
# How many generations above a gVisor exec's host process its container's shim may be.
SHIM_GENERATIONS = 3
# The most processes a helper given up on is found to have started (a pipeline is a few).
MAX_DESCENDANTS = 256

SANDBOX_SHELL = "/bin/sh"  # the image's POSIX shell, for helpers written as scripts

# The exit code of a process (an exec, a container's init) ended by SIGKILL, as the OOM killer does.
SIGKILL_EXIT = 128 + 9

# dockerd gives an exec's output at most 2 s after its process exits to reach the client, then
# closes the stream (moby's daemon/monitor.go, EventExit): a reader further behind, as a loaded
# host makes the gateway, loses the end of the output, cut at any byte (a rehearsal's captures
# ended in the middle of a frame; cut at a frame's end, a file read or an archive would have been
# short and nobody told). So a helper whose output matters is held: a shell runs it with stdin
# closed, writes a trailer (a token of the host's and the exit status) after its output, and
# exits only when the host, having read the trailer, closes the exec's stdin. Its process ends
# after its output was read, whatever the host's load.
HOLD_SCRIPT = '"$@" </dev/null; s=$?; printf "%s:%03d" "$0" "$s"; read -r line; exit "$s"'
# After the trailer, the seconds the rest of a held helper's stream may take to end (stderr on
# its way, the holder's exit) before the holder is killed: its status is already known.
RELEASE_GRACE = 5.0


class ExecStreamError(SandkernelError):
    """An exec's stream broke, stalled or passed its deadline (the message says which)."""

    status = 504
    code = "sandbox_helper_failed"


class Deadline:
    """A wall-clock limit for one exec (None: none), and the flag a cancelled caller sets."""

    def __init__(self, seconds: float | None, stop: threading.Event | None = None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds
        self.stop = stop or threading.Event()

    def check(self, what: str) -> None:
        if self.stop.is_set():
            raise ExecStreamError(f"{what} was cancelled")
        if self.at is not None and time.monotonic() > self.at:
            raise ExecStreamError(f"{what} did not finish within its {self.seconds:g} s limit")

    def socket_timeout(self) -> float:
        """A read's timeout: the idle timeout, or less when the deadline comes first."""
        if self.at is None:
            return IDLE_TIMEOUT
        return max(0.05, min(IDLE_TIMEOUT, self.at - time.monotonic()))


def start_exec(api: Any, container_id: str, exec_id: str, deadline: Deadline, what: str) -> ExecSocket:
    """docker-py's ``exec_start(exec_id, socket=True)``, with its wait bounded by the deadline.

    dockerd answers the start only once the new process runs, and a sandbox can stop that
    process while it is still runc's init (before it is the helper at all): the SDK's own call
    then waits for its client timeout (120 s), holding a worker thread, and dockerd holds the
    container's lock meanwhile (every later exec of it waits). The same request is sent here
    with the deadline as its read timeout (the SDK's request helpers, as exec_start uses them);
    at the deadline the stopped init is killed, which ends dockerd's wait."""
    deadline.check(what)
    try:
        response = api._post_json(
            api._url("/exec/{0}/start", exec_id),
            headers={"Connection": "Upgrade", "Upgrade": "tcp"},
            data={"Tty": False, "Detach": False},
            stream=True,
            timeout=deadline.socket_timeout(),
        )
    except requests.exceptions.Timeout as err:
        kill_stopped_runc_inits(container_id)
        deadline.check(what)
        raise ExecStreamError(f"{what}: the sandbox did not start it within {IDLE_TIMEOUT:g} s") from err
    sdk_socket = api._get_raw_response_socket(response)
    raw = getattr(sdk_socket, "_sock", sdk_socket)
    return ExecSocket(sdk_socket, raw, read_with_the_headers(response, raw))


def read_with_the_headers(response: Any, raw: socket.socket) -> bytes:
    """The stream's bytes that http.client's buffered reader took along with the upgrade's
    headers (see :class:`ExecSocket`): what its buffer holds, read without waiting."""
    buffered = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if buffered is None or not hasattr(buffered, "read1"):
        return b""
    previous = raw.gettimeout()
    raw.settimeout(0)  # an empty buffer reads the socket once: it must not wait
    try:
        return buffered.read1(CHUNK) or b""
    except OSError:  # nothing more now (EAGAIN), or the stream broke: the next recv says which
        return b""
    finally:
        raw.settimeout(previous)


class ExecSocket:
    """An exec's attach stream: its socket, and the first bytes of the stream that arrived with
    dockerd's answer to the start.

    dockerd writes the upgrade's headers, then starts the process, whose output follows on the
    same connection. http.client reads the headers through a buffered reader, which takes
    whatever the socket holds at that moment; docker-py then hands over the socket under it, and
    what that buffer held was lost. On a loaded host the helper's first frames are often there
    by the time the gateway's thread reads the headers: a lost frame header made the reader take
    bytes of the output for a header and wait for a length that never came (a held helper then
    gave nothing until its 60 s deadline: a rehearsal's download, a pause's tar; a helper not
    held ended "in the middle of a frame"). Reads serve those bytes first."""

    def __init__(self, sdk_socket: Any, raw: socket.socket, early: bytes) -> None:
        self._sdk_socket = sdk_socket  # closed with the stream (it holds docker-py's response)
        self.raw = raw
        self._early = early

    def recv(self, n: int) -> bytes:
        if self._early:
            taken, self._early = self._early[:n], self._early[n:]
            return taken
        return self.raw.recv(n)

    def send(self, data: bytes | memoryview) -> int:
        return self.raw.send(data)

    def settimeout(self, seconds: float | None) -> None:
        self.raw.settimeout(seconds)

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self._sdk_socket.close()


def frames(raw: ExecSocket, deadline: Deadline, what: str) -> Iterator[tuple[int, bytes]]:
    """Docker's multiplexed stream (8-byte header: stream number, length) as (stream, bytes), up
    to 1 MiB a piece; ends at EOF. ExecStreamError when the deadline passes, the socket stays
    silent for the idle timeout, or the caller stopped waiting."""
    while True:
        header = _recv_exactly(raw, 8, deadline, what)
        if header is None:
            return
        stream, remaining = struct.unpack(">BxxxL", header)
        while remaining:
            data = recv(raw, min(remaining, CHUNK), deadline, what)
            if not data:
                raise ExecStreamError(f"{what}: the sandbox's output ended in the middle of a frame")
            remaining -= len(data)
            yield stream, data


def _recv_exactly(raw: ExecSocket, n: int, deadline: Deadline, what: str) -> bytes | None:
    """``n`` bytes, or None at a clean EOF before the first one."""
    buf = b""
    while len(buf) < n:
        data = recv(raw, n - len(buf), deadline, what)
        if not data:
            if buf:
                raise ExecStreamError(f"{what}: the sandbox's output ended in the middle of a frame header")
            return None
        buf += data
    return buf


def recv(raw: ExecSocket, n: int, deadline: Deadline, what: str) -> bytes:
    """One read of at most ``n`` bytes, within the deadline (the timeout is set per read)."""
    deadline.check(what)
    raw.settimeout(deadline.socket_timeout())
    try:
        return raw.recv(n)
    except TimeoutError as err:
        deadline.check(what)  # the deadline, if that is what ended the wait
        raise ExecStreamError(f"{what}: the sandbox was silent for {IDLE_TIMEOUT:g} s and was given up") from err
    except OSError as err:
        raise ExecStreamError(f"{what}: the connection to the sandbox broke ({err})") from err


def send_all(raw: ExecSocket, data: bytes, deadline: Deadline, what: str) -> None:
    """Write ``data`` to the exec's stdin within the deadline (a sandbox that stops reading
    stalls the write: each chunk's wait is bounded like a read's)."""
    view = memoryview(data)
    while view:
        deadline.check(what)
        raw.settimeout(deadline.socket_timeout())
        try:
            sent = raw.send(view[:CHUNK])
        except TimeoutError as err:
            deadline.check(what)
            raise ExecStreamError(f"{what}: the sandbox took nothing for {IDLE_TIMEOUT:g} s and was given up") from err
        view = view[sent:]


def exit_code(api: Any, exec_id: str, deadline: Deadline, what: str) -> int:
    """The exec's exit code; its stream ends a moment before Docker records the exit."""
    limit = time.monotonic() + EXIT_GRACE
    while True:
        state = api.exec_inspect(exec_id)
        if not state.get("Running"):
            code = state.get("ExitCode")
            return -1 if code is None else int(code)
        if time.monotonic() > limit:
            raise ExecStreamError(f"{what}: the sandbox's process did not exit after its output ended")
        deadline.check(what)
        time.sleep(0.02)


def held_argv(argv: list[str], token: str) -> list[str]:
    """``argv`` run by the holding shell (see :data:`HOLD_SCRIPT`), with the host's token."""
    return [SANDBOX_SHELL, "-c", HOLD_SCRIPT, token, *argv]


class HeldOutput:
    """A held exec's frames, the trailer taken off its stdout; the exec's stdin is closed (which
    lets its shell exit) once the trailer has been read, and the rest of the stream (stderr
    still on its way, then EOF) is read for at most :data:`RELEASE_GRACE` seconds more: a holder
    that does not go by then is killed (:meth:`finish`), its status already known from the trailer.

    The sandbox can read the token (the shell's argv is its own) and write a trailer of its own
    making: that only releases its own helper early; output after a trailer means it was not
    the end, and the output is then not believed complete."""

    def __init__(self, raw: ExecSocket, deadline: Deadline, what: str, token: str) -> None:
        self.raw, self.what = raw, what
        self.token = token.encode()
        self.trailer_bytes = len(self.token) + 4  # token, ":", three digits
        self.complete = False  # the stream's last stdout bytes were a trailer
        self.lingering = False  # released, but the stream had not ended within RELEASE_GRACE
        self.status: int | None = None  # the program's exit status, from the trailer
        # The caller's deadline, shortened to the grace once released (the caller's own is kept).
        self._reading = Deadline(deadline.seconds, deadline.stop)
        self._reading.at = deadline.at
        self._released = False

    def _is_trailer(self, tail: bytes) -> bool:
        return (
            len(tail) == self.trailer_bytes and tail[: len(self.token) + 1] == self.token + b":" and tail[-3:].isdigit()
        )

    def _release(self) -> None:
        self._released = True
        with contextlib.suppress(OSError):  # the stream is gone: frames() says so at its next read
            self.raw.shutdown(socket.SHUT_WR)
        grace_ends = time.monotonic() + RELEASE_GRACE
        if self._reading.at is None or grace_ends < self._reading.at:
            self._reading.seconds, self._reading.at = RELEASE_GRACE, grace_ends

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        tail = b""
        try:
            for stream, data in frames(self.raw, self._reading, self.what):
                if stream != 1:
                    yield stream, data
                    continue
                tail += data
                if not self._released and self._is_trailer(tail[-self.trailer_bytes :]):
                    self._release()  # before the caller's work on the output: the shell may go
                if len(tail) > self.trailer_bytes:
                    yield 1, tail[: -self.trailer_bytes]
                    tail = tail[-self.trailer_bytes :]
        except ExecStreamError:
            if not (self._released and self._is_trailer(tail)) or self._reading.stop.is_set():
                raise
            self.lingering = True  # the output is whole; the holder did not go: finish() kills it
        self.complete = self._is_trailer(tail)
        if self.complete:
            self.status = int(tail[-3:])
        elif tail:
            yield 1, tail  # a process ended before its trailer: its output as it was

    def finish(self, api: Any, container_id: str, exec_id: str, deadline: Deadline) -> int:
        """The program's exit status, once its output was read: the trailer's (a holder that
        lingered is killed), else Docker's exit code of the holder. ExecStreamError when the
        output ended without its trailer although the holder was not killed (a code below 128:
        the shell writes its trailer before it exits, so the stream was cut; a killed holder's
        code says it was killed, and its output is as far as it got)."""
        if self.status is not None:
            if self.lingering:
                log.warning("%s: its holder did not exit once released; killed", self.what)
                kill_exec(api, container_id, exec_id)
            return self.status
        return self.judged(exit_code(api, exec_id, deadline, self.what))

    def judged(self, code: int) -> int:
        """``code``, the holder's exit code, for output that ended without its trailer: an
        ExecStreamError unless the holder was killed (see :meth:`finish`)."""
        if code < 128:
            raise ExecStreamError(f"{self.what}: the sandbox's output was cut short before its end")
        return code


def start_held(
    api: Any, container_id: str, user: str, argv: list[str], deadline: Deadline, what: str, workdir: str | None
) -> tuple[str, ExecSocket, HeldOutput]:
    """Create and start ``argv`` held (see :data:`HOLD_SCRIPT`): (exec id, the SDK's socket,
    its output). The caller closes the socket, checks the exit code with ``output.check`` and
    kills the exec (:func:`kill_exec`) if it gives up."""
    token = secrets.token_hex(16)
    exec_id = api.exec_create(container_id, held_argv(argv, token), user=user, workdir=workdir, stdin=True)["Id"]
    sock = start_exec(api, container_id, exec_id, deadline, what)
    return exec_id, sock, HeldOutput(sock, deadline, what, token)


def kill_exec(api: Any, container_id: str, exec_id: str) -> bool:
    """SIGKILL an exec given up on, if it still runs. Docker has no call for it; its host process
    is killed when /proc shows it is this container's exec (:func:`is_containers_exec`: a gateway
    in another pid namespace, or a pid reused meanwhile, kills nothing). True if a kill was sent.

    First, an exec the sandbox stopped while it was still runc's init (dockerd answers the start
    at once, then waits for it holding the container's lock, so even an inspect would wait) is
    killed by :func:`kill_stopped_runc_inits`."""
    if kill_stopped_runc_inits(container_id):
        return True
    pid = exec_pid(api, exec_id)
    return pid is not None and _kill_exec_process(pid, container_id)


def exec_pid(api: Any, exec_id: str) -> int | None:
    """The host pid of a running exec; None once it ended (or if Docker cannot say). dockerd says
    an exec runs before it knows its pid (0 for a moment after the start under gVisor): that is
    waited for, at most :data:`PID_GRACE` seconds."""
    known_by = time.monotonic() + PID_GRACE
    while True:
        try:
            state = api.exec_inspect(exec_id)
        except Exception:  # best effort: the caller's error says what happened
            return None
        pid = state.get("Pid")
        if not state.get("Running") or not isinstance(pid, int):
            return None
        if pid > 1:
            return pid
        if time.monotonic() > known_by:
            return None
        time.sleep(0.02)


def is_containers_exec(pid: int, container_id: str) -> bool:
    """Whether host process ``pid`` is an exec of ``container_id``: under runc the exec's own
    process, in the container's cgroup; under gVisor its ``runsc exec``, a host process outside
    that cgroup (the sandbox's processes are not the host's), a child of the container's
    containerd shim (looked for a few generations up). The shim is known by its arguments
    (``-id`` and the container's id) and by
    standing outside the container's cgroup: a runc sandbox's process can take any arguments,
    but never leave its cgroup, and a gVisor sandbox makes no host process at all."""
    if _in_cgroup(pid, container_id):
        return True
    wanted = container_id.encode()
    ancestor = pid
    for _ in range(SHIM_GENERATIONS):
        ancestor = _parent(ancestor) or 0
        if ancestor <= 1 or _in_cgroup(ancestor, container_id):
            return False
        try:
            with open(f"/proc/{ancestor}/cmdline", "rb") as cmdline:
                args = cmdline.read().split(b"\0")
        except OSError:
            return False
        if any(flag == b"-id" and value == wanted for flag, value in itertools.pairwise(args)):
            return True
    return False


def _kill_exec_process(pid: int, container_id: str) -> bool:
    """SIGKILL ``pid`` through a pidfd (a pid reused once checked is never hit) if it is this
    container's exec, and under runc what it started too (a held helper's program is the exec's
    child, and a pipeline's commands its grandchildren: all go, found before any is killed).
    Under gVisor the kill ends ``runsc exec``: Docker records the exec's end and the host
    process (about 20 MB each) is gone; what it ran inside the sandbox stays there, on the
    sandbox's own limits, until the sandbox goes."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone
    try:
        if not is_containers_exec(pid, container_id):
            return False
        for descendant in _descendants(pid):
            if _in_cgroup(descendant, container_id):
                _kill(descendant)
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


def _in_cgroup(pid: int, container_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup", encoding="ascii", errors="replace") as cgroup:
            return container_id in cgroup.read()
    except OSError:
        return False


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("PPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _descendants(pid: int, limit: int = MAX_DESCENDANTS) -> list[int]:
    """``pid``'s children, theirs and so on (at most ``limit``), read from /proc."""
    found: list[int] = []
    queue = [pid]
    while queue and len(found) < limit:
        for child in _children(queue.pop()):
            if child not in found:
                found.append(child)
                queue.append(child)
    return found[:limit]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as children:
            return [int(word) for word in children.read().split() if word.isdigit()]
    except OSError:
        return []


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


def run_helper(
    api: Any,
    container_id: str,
    user: str,
    argv: list[str],
    deadline: Deadline,
    what: str,
    *,
    stdin: bytes | None = None,
    workdir: str | None = None,
    max_output: int = 64 * 1024 * 1024,
    hold: bool = True,
) -> tuple[int, bytes, bytes]:
    """Run ``argv`` in the container as ``user`` (blocking: call it in a worker thread) and
    return (exit code, stdout, stderr). ``stdin`` is sent first, then closed. ExecStreamError
    when the deadline passes, the output passes ``max_output`` bytes or the stream breaks; the
    helper is then killed where it can be (:func:`kill_exec`).

    Held (see :data:`HOLD_SCRIPT`) unless ``stdin`` is given (a helper fed stdin answers in a
    few bytes) or ``hold`` is False: a helper that kills the sandbox user's processes would kill
    its own holding shell."""
    # Not started in time: start_exec killed it (an inspect of it would wait on dockerd).
    held: HeldOutput | None = None
    if hold and stdin is None:
        exec_id, sock, held = start_held(api, container_id, user, argv, deadline, what, workdir)
    else:
        exec_id = api.exec_create(container_id, argv, user=user, workdir=workdir, stdin=stdin is not None)["Id"]
        sock = start_exec(api, container_id, exec_id, deadline, what)
    finished = False
    try:
        if stdin is not None:
            send_all(sock, stdin, deadline, what)
            sock.shutdown(socket.SHUT_WR)
        output: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        for stream, data in held if held is not None else frames(sock, deadline, what):
            kept = output.setdefault(stream, bytearray())
            if len(kept) + len(data) > max_output:
                raise ExecStreamError(f"{what}: the sandbox's output passed {max_output} bytes")
            kept += data
        if held is not None:
            code = held.finish(api, container_id, exec_id, deadline)
        else:
            code = exit_code(api, exec_id, deadline, what)
        finished = True
    finally:
        sock.close()
        if not finished:
            kill_exec(api, container_id, exec_id)
    return code, bytes(output[1]), bytes(output[2])
