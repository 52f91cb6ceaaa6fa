"""The session layer: one sandboxed kernel and the one ``execute`` every door goes through.

The gateway's session API, its Jupyter websocket, the agent and replay all call
:meth:`KernelSession.execute`, so outputs, limits and (later) the transcript are identical
whichever way the code came in. Executions on one kernel are serialised by a lock; a
watchdog beside each one notices a dead kernel; a wall-clock timeout climbs a ladder:
interrupt → (grace) → restart the kernel → replace the container, and says which rung ended it.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import datetime as dt
import json
import logging
import queue
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.asynchronous.client import AsyncKernelClient

from sandkernel.errors import ArgumentTypeError, ConfigError, KernelStartError, SandkernelError, SessionClosedError
from sandkernel.kernels.execution.outputs import (
    ExecutionResult,
    ExecutionStatus,
    OutputCallback,
    OutputCollector,
    TimeoutStep,
)
from sandkernel.kernels.lifecycle.profiles import Profile, resolve_profile
from sandkernel.kernels.sandbox.container import SandboxContainer
from sandkernel.kernels.sandbox.kernelspec import SandkernelSpecManager, kernel_name_for
from sandkernel.kernels.sandbox.provisioner import DockerProvisioner
from sandkernel.notebooks.recorder import TranscriptRecorder

log = logging.getLogger(__name__)

# Evaluated in the kernel by variables(): one JSON string, no side effects, bounded length.
VARIABLES_EXPRESSION = (
    "(lambda ns, hidden, json=__import__('json'), sys=__import__('sys'): json.dumps(["
    "{'name': k, 'type': type(v).__module__ + '.' + type(v).__qualname__"
    " if type(v).__module__ != 'builtins' else type(v).__qualname__,"
    " 'size': int(getattr(v, 'nbytes', 0) or 0) or (len(v) if isinstance(v, (str, bytes, list, tuple, dict, set))"
    " else sys.getsizeof(v)),"
    " 'shape': list(v.shape) if isinstance(getattr(v, 'shape', None), tuple) else None}"
    " for k, v in list(ns.items())[:2000] if not k.startswith('_') and k not in hidden"
    " and type(v).__name__ not in ('module', 'function', 'builtin_function_or_method', 'type')]))"
    "(get_ipython().user_ns, get_ipython().user_ns_hidden)"
)
# The largest single ZMQ message accepted from a kernel (bytes); larger ones drop the connection.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How many kernel messages may wait in our receive queue per shell/control/stdin socket. The
# kernel sends these only in reply to the host's requests, and they are read or drained promptly.
RECEIVE_QUEUE_MESSAGES = 64
# How many kernel messages may wait in the receive queue of each iopub subscriber (ours and each
# websocket's). Kernel output is what untrusted code controls, so this is the bound that counts:
# a subscriber holds at most (IOPUB_RECEIVE_QUEUE + 1) x MAX_MESSAGE_BYTES (the +1 is the message
# ZMQ is decoding), 192 MiB, even when nobody reads; past it, the kernel's own (memory-limited)
# send queue fills and then drops. Ours is drained between executes, so in practice it holds one.
IOPUB_RECEIVE_QUEUE = 2
# How long the between-executes drain waits for kernel messages before re-checking (seconds).
DRAIN_POLL_SECONDS = 1.0
# iopub message types that carry output (counted in the "output after the cell returned" note).
OUTPUT_MSG_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result", "error"})
# How often a silent execution checks that its kernel is still alive (seconds).
WATCHDOG_INTERVAL = 0.5
# How long iopub may lag behind a reply that already arrived before the subscription is taken
# for cut and renewed (seconds). The kernel publishes outputs from a thread of its own: starved
# of CPU (another tenant's attack on a 2-core host, gVisor), it can trail the shell reply by
# seconds, and renewing the subscription then would drop the very outputs that were on the way.
IOPUB_PROBE_SECONDS = 10.0
# How long to wait for the execute_reply once the kernel went idle (seconds).
REPLY_TIMEOUT = 5.0


@contextlib.contextmanager
def _iopub_receive_queue(context: zmq.Context) -> Iterator[None]:
    """Sockets made inside get the iopub receive queue (IOPUB_RECEIVE_QUEUE messages); the
    context's default is restored after. Our event loop is single-threaded, so nothing else
    makes a socket on this context meanwhile."""
    context.setsockopt(zmq.RCVHWM, IOPUB_RECEIVE_QUEUE)
    try:
        yield
    finally:
        context.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)


def connect_iopub(km: AsyncKernelManager) -> zmq.asyncio.Socket:
    """A new iopub subscriber on ``km``'s kernel with the bounded receive queue (the gateway's
    websocket relay makes one per connection)."""
    with _iopub_receive_queue(km.context):
        return km.connect_iopub()


def _utcnow() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


# Added to an execution whose outputs were cut off with the iopub subscription.
OUTPUT_LOST_NOTE = {
    "header": {"msg_type": "stream"},
    "parent_header": {},
    "content": {
        "name": "stderr",
        "text": f"[sandkernel: output lost: the kernel sent a message over the {MAX_MESSAGE_BYTES // 2**20} MiB "
        "transport limit; the output channel was reconnected]\n",
    },
}


class KernelSession:
    """A sandboxed IPython kernel with a serialised, bounded ``execute``.

    Create with ``await KernelSession.start(profile=..., overrides=...)`` or use it as an async
    context manager; :meth:`shutdown` removes the container and its runtime dir.
    """

    def __init__(
        self,
        profile: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        recorder: TranscriptRecorder | None = None,
    ) -> None:
        # Validate everything that can be validated before a container exists.
        self.profile: Profile = resolve_profile(profile, overrides)
        self._profile_name = profile
        self._overrides = dict(overrides or {})
        self.id = session_id or uuid.uuid4().hex
        kernel_name = kernel_name_for(self.profile.runtime)
        self._km = self._new_kernel_manager(kernel_name)
        self._client: AsyncKernelClient | None = None
        self._lock = asyncio.Lock()
        self._epoch = 0  # bumped on every restart; a running execute notices it
        self._pending_state_lost: str | None = None
        self._interrupt_requested = False
        self._early_reply: dict[str, Any] | None = None
        self._oom_baseline: int | None = None
        self._notes: list[str] = []  # state-loss notes for the transcript, written after the cell
        self.recorder = recorder
        self._closed = False
        # The host reads the kernel's channels only while it waits for something (an execute, a
        # restart); between those, _drain discards what arrives so nothing piles up in our
        # receive queues, and counts the output it threw away for a transcript note.
        self._readers = 0
        self._channels_free = asyncio.Event()
        self._channels_free.set()
        self._drainer: asyncio.Task | None = None
        self._discarded = [0, 0]  # output messages, bytes thrown away since the last note

    @staticmethod
    def _new_kernel_manager(kernel_name: str) -> AsyncKernelManager:
        """A kernel manager whose ZMQ sockets refuse oversized messages from the kernel: kernel
        output is untrusted, and one 1 GB message would otherwise sit in host memory."""
        km = AsyncKernelManager(kernel_name=kernel_name, kernel_spec_manager=SandkernelSpecManager())
        km.context.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # A flooding kernel queues in its own (memory-limited) send buffer, not in ours; when
        # the queue is full PUB drops messages, which the shell-reply fallback in _collect covers.
        km.context.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        return km

    @classmethod
    async def start(
        cls,
        profile: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        recorder: TranscriptRecorder | None = None,
    ) -> KernelSession:
        session = cls(profile, overrides, session_id, None)
        await session._start_kernel()
        if recorder is not None:
            await session.attach_recorder(recorder)
        return session

    async def attach_recorder(self, recorder: TranscriptRecorder) -> None:
        """Start recording into ``recorder`` (at start, or when a warm-pool session is handed out)."""
        self.recorder = recorder
        recorder.update_metadata(**self.describe())
        await recorder.start()
        proxy = self.provisioner.egress
        if proxy is not None:  # the transcript keeps a running summary of the session's egress
            proxy.on_record = lambda _record: recorder.update_metadata(egress=proxy.summary())

    def egress_records(self) -> list[dict[str, Any]] | None:
        """Every request through this session's egress proxy; None when its network is "none"."""
        proxy = self.provisioner.egress
        return None if proxy is None else [record.to_dict() for record in proxy.records]

    def describe(self) -> dict[str, Any]:
        """What a transcript reader needs to know about this sandbox."""
        provisioner = self.provisioner
        return {
            "session_id": self.id,
            "kernel_id": self.kernel_id,
            "image": self.profile.image,
            "image_id": provisioner.image_id,
            "runtime": self.profile.runtime.value,
            "limits": self.profile.to_dict(public=True),  # tenants can read the transcript
        }

    async def __aenter__(self) -> KernelSession:
        if self._client is None:
            await self._start_kernel()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- properties -----------------------------------------------------------------------

    @property
    def kernel_id(self) -> str:
        return str(self._km.kernel_id)

    @property
    def kernel_manager(self) -> AsyncKernelManager:
        return self._km

    @property
    def provisioner(self) -> DockerProvisioner:
        provisioner = self._km.provisioner
        if not isinstance(provisioner, DockerProvisioner):
            raise SessionClosedError(f"session {self.id} has no running kernel")
        return provisioner

    @property
    def container(self) -> SandboxContainer:
        container = self.provisioner.container
        if container is None:
            raise SessionClosedError(f"session {self.id} has no container")
        return container

    # -- lifecycle ------------------------------------------------------------------------

    async def _start_kernel(self) -> None:
        try:
            await self._km.start_kernel(
                sandkernel_profile=self._profile_name,
                sandkernel_overrides=self._overrides,
                sandkernel_session_id=self.id,
            )
            self._client = self._km.client(context=self._km.context)
            with _iopub_receive_queue(self._km.context):
                self._client.iopub_channel.start()
            self._client.start_channels()
            with self._reading():
                await self._wait_ready()
        except BaseException:
            await self._teardown()
            raise
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain(), name=f"sandkernel-drain-{self.id}")
        log.info("session started", extra={"session": self.id, "kernel": self.kernel_id})

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Held while something of ours reads the kernel's channels: the drain keeps off them."""
        self._readers += 1
        self._channels_free.clear()
        try:
            yield
        finally:
            self._readers -= 1
            if not self._readers:
                self._channels_free.set()

    async def _drain(self) -> None:
        """Between executes, read and discard whatever the kernel sends (a background thread's
        output, stale replies), so no receive queue of ours holds kernel output while nobody
        waits for it. Output messages of our own requests are counted for a transcript note;
        those answering a websocket client's request are its relay's to show. Owned by the
        session: started with the kernel, cancelled by :meth:`shutdown`."""
        while True:
            await self._channels_free.wait()
            client = self._client
            if client is None or client.iopub_channel.socket is None or client.shell_channel.socket is None:
                await asyncio.sleep(DRAIN_POLL_SECONDS)
                continue
            poller = zmq.asyncio.Poller()
            channels = {client.iopub_channel.socket: "iopub", client.shell_channel.socket: "shell"}
            for sock in channels:
                poller.register(sock, zmq.POLLIN)
            try:
                ready = await poller.poll(DRAIN_POLL_SECONDS * 1000)
            except zmq.ZMQError:  # the channels were closed under us (restart, replacement)
                await asyncio.sleep(DRAIN_POLL_SECONDS)
                continue
            # No await from here on: an execute cannot start reading while we discard.
            if self._readers or self._client is not client:
                continue
            for sock, _ in ready:
                self._discard_ready(sock, channels[sock])

    def _discard_ready(self, sock: zmq.asyncio.Socket, channel: str) -> None:
        """Discard the messages ``sock`` holds now (without waiting), counting our output.

        EVENTS is checked before each receive so no ``zmq.Again`` is raised: pyzmq keeps a raised
        exception in a future whose reference cycle would hold our frame, and with it the last
        60 MB message, until the garbage collector ran."""
        for _ in range(IOPUB_RECEIVE_QUEUE + RECEIVE_QUEUE_MESSAGES):
            try:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                counted = self._discard_one(sock.recv_multipart(flags=zmq.DONTWAIT, copy=False).result())
            except zmq.ZMQError:
                return
            if channel == "iopub" and counted:
                self._discarded[0] += 1
                self._discarded[1] += counted

    def _discard_one(self, frames: list[zmq.Frame]) -> int:
        """Bytes of ``frames`` when it is output answering one of our requests, else 0."""
        assert self._client is not None
        return sum(len(frame) for frame in frames) if _is_our_output(frames, self._client.session.session) else 0

    async def _wait_ready(self) -> None:
        """Wait until the kernel answers on shell AND its iopub reaches us.

        A SUB socket joins late (more so across gVisor): without the nudge the first
        execute's ``idle`` status can be lost and the execute would wait for its timeout.
        """
        assert self._client is not None
        deadline = time.monotonic() + self.profile.start_timeout
        try:
            await self._client.wait_for_ready(timeout=self.profile.start_timeout)
        except RuntimeError as err:
            raise KernelStartError(f"sandboxed kernel did not answer: {err}") from err
        while time.monotonic() < deadline:
            if await self._iopub_answers(0.25):
                return
        raise KernelStartError(f"the kernel's output channel did not connect within {self.profile.start_timeout:g}s")

    async def _iopub_answers(
        self, wait: float, msg_id: str | None = None, collector: OutputCollector | None = None
    ) -> bool:
        """Send a kernel_info request and wait up to ``wait`` seconds for its status on iopub.

        Messages of a running execution ``msg_id`` that arrive meanwhile go to ``collector``."""
        assert self._client is not None
        probe_id = self._client.kernel_info()
        deadline = time.monotonic() + wait
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = await self._next_message("iopub", remaining)
            except queue.Empty:
                return False
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent == probe_id:
                return True
            if collector is not None and parent == msg_id and msg["header"]["msg_type"] != "status":
                await collector.add(msg)
        return False

    async def _reconnect_iopub(self) -> None:
        """A fresh iopub subscription. ZMQ drops a subscriber that receives a message over the
        transport's size cap and does not bring it back: without this, every later output of
        the session would be lost."""
        assert self._client is not None
        log.warning("iopub went silent (a message over the size cap?); reconnecting", extra={"session": self.id})
        with contextlib.suppress(Exception):
            self._client.iopub_channel.stop()
        self._client._iopub_channel = None
        with _iopub_receive_queue(self._km.context):
            self._client.iopub_channel.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not await self._iopub_answers(0.25):
            pass

    async def _teardown(self) -> None:
        if self._client is not None:
            self._client.stop_channels()
        if self._km.provisioner is not None:
            with contextlib.suppress(SandkernelError, RuntimeError):
                await self._km.shutdown_kernel(now=True)
            if isinstance(self._km.provisioner, DockerProvisioner):
                await self._km.provisioner.cleanup(restart=False)

    async def shutdown(self) -> None:
        """Stop the kernel and remove its container and runtime dir. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
            self._drainer = None
        await self._teardown()
        await self._note_discarded()
        if self.recorder is not None:
            await self.recorder.close()
        log.info("session shut down", extra={"session": self.id})

    async def variables(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """A cheap listing of the user's namespace: name, type, size (len or bytes), shape.

        Evaluated as a silent ``user_expressions`` request: no output, no execution count. The
        transcript gets a note that it ran (it is an audit record). Queued behind running
        executions like any request.
        """
        self._check_open()
        async with self._lock:
            assert self._client is not None
            await self._note_discarded()
            if self.recorder is not None:
                await self.recorder.note("the session's variables were listed (a silent `user_expressions` request)")
            with self._reading():
                return await self._list_variables(timeout)

    async def _list_variables(self, timeout: float) -> list[dict[str, Any]]:
        assert self._client is not None
        msg_id = self._client.execute(
            "", silent=True, store_history=False, user_expressions={"vars": VARIABLES_EXPRESSION}
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = await self._next_message("shell", max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            found = msg["content"].get("user_expressions", {}).get("vars", {})
            if found.get("status") != "ok":
                raise SandkernelError(f"listing variables failed: {found.get('evalue', 'no reply')}")
            return json.loads(ast.literal_eval(found["data"]["text/plain"]))
        raise SandkernelError(f"the kernel did not list its variables within {timeout:g}s; is it busy?")

    async def wait_idle(self) -> None:
        """Return once no execution is running (the next queued one may start right after)."""
        async with self._lock:
            pass

    async def interrupt(self) -> None:
        """Interrupt the running execution (it ends with status ``interrupted``)."""
        self._check_open()
        self._interrupt_requested = True
        await self._km.interrupt_kernel()

    async def restart(self) -> None:
        """Restart the kernel: memory state is dropped, /workspace files are kept."""
        self._check_open()
        # Not behind the execute lock: restart is how a caller rescues a stuck execution (the
        # running execute sees the epoch change and returns kernel_died).
        await self._note_discarded()
        await self._restart_kernel("the kernel was restarted on request")
        await self._flush_notes()

    async def _note_discarded(self) -> None:
        """Tell the transcript how much output arrived while no execution was running."""
        (messages, size), self._discarded = self._discarded, [0, 0]
        if messages and self.recorder is not None:
            await self.recorder.note(
                f"output after the cell returned: {messages} messages, {size} bytes discarded "
                "(code kept writing while no execution was running)"
            )

    async def _flush_notes(self) -> None:
        notes, self._notes = self._notes, []
        if self.recorder is not None:
            for note in notes:
                await self.recorder.note(note)

    async def _restart_kernel(self, reason: str) -> TimeoutStep:
        """Restart and report whether the container had to be replaced (workspace lost)."""
        self._epoch += 1
        provisioner = self.provisioner
        provisioner.workspace_lost = False
        with self._reading():
            await self._km.restart_kernel(now=True)
            await self._wait_ready()
        replaced = provisioner.workspace_lost
        if replaced:
            self._oom_baseline = None
        self._pending_state_lost = reason + (
            "; the container was replaced, so /workspace files are gone too"
            if replaced
            else "; variables and imports are gone, /workspace files are kept"
        )
        self._notes.append(self._pending_state_lost)
        return TimeoutStep.KILL if replaced else TimeoutStep.RESTART

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session {self.id} is shut down; start a new session")

    # -- execute --------------------------------------------------------------------------

    async def execute(
        self,
        code: str,
        timeout: float | None = None,
        on_output: OutputCallback | None = None,
        tag: str | None = None,
        source: str | None = None,
    ) -> ExecutionResult:
        """Run ``code`` in the kernel and return its ordered outputs and status.

        ``on_output`` is awaited with each output (nbformat shape) as it arrives, for streaming.

        ``timeout`` is wall-clock seconds (default: the profile's ``execute_timeout``). Errors
        in the code are returned as status ``error``; timeouts, interrupts, kernel deaths and
        OOM kills as their statuses. Raises only for bad arguments or a closed session.
        """
        if not isinstance(code, str):
            raise ArgumentTypeError(f"code must be a string of Python source, not {type(code).__name__}")
        if timeout is None:
            timeout = self.profile.execute_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ConfigError(f"timeout must be a number of seconds between 0 and 86400, not {timeout!r}")
        self._check_open()
        async with self._lock:
            self._check_open()
            await self._note_discarded()
            with self._reading():
                result = await self._execute_locked(code, float(timeout), on_output)
            if self.recorder is not None:
                await self.recorder.record(code, result, tag=tag, source=source)
            await self._flush_notes()
            return result

    async def _execute_locked(self, code: str, timeout: float, on_output: OutputCallback | None) -> ExecutionResult:
        assert self._client is not None
        if not await self._km.is_alive():
            status = await self._death_status(None)
            await self._restart_kernel(self._death_sentence(status, between_executes=True))
        state_lost, self._pending_state_lost = self._pending_state_lost, None
        started_at, t0 = _utcnow(), time.monotonic()
        if self._oom_baseline is None:  # read once per container, not on every execute
            self._oom_baseline = await self.container.oom_kill_count()
        oom_before = self._oom_baseline
        epoch = self._epoch
        self._interrupt_requested = False
        self._early_reply = None
        collector = OutputCollector(on_output)
        msg_id = self._client.execute(code, allow_stdin=False, stop_on_error=False)
        status = await self._collect(msg_id, collector, t0 + timeout, epoch)
        ended_by: TimeoutStep | None = None
        if status is ExecutionStatus.TIMEOUT:
            ended_by = await self._stop_runaway(msg_id, collector, timeout)
        elif status is ExecutionStatus.KERNEL_DIED and epoch == self._epoch:
            status = await self._death_status(oom_before)
            await self._restart_kernel(self._death_sentence(status, between_executes=False))
        elif status is ExecutionStatus.OK:
            status = await self._reply_status(msg_id, collector)
        # A restart during this execution is reported now and again by the next one.
        state_lost = self._pending_state_lost or state_lost
        return ExecutionResult(
            status=status,
            outputs=collector.finished_outputs(),
            execution_count=collector.execution_count,
            started_at=started_at,
            duration=round(time.monotonic() - t0, 6),
            error=collector.error,
            ended_by=ended_by,
            state_lost=state_lost,
            chars_cut=collector.chars_cut,
            outputs_dropped=collector.outputs_dropped,
            bytes_omitted=collector.bytes_omitted,
        )

    async def _next_message(self, channel: str, timeout: float) -> dict[str, Any]:
        """The next message on iopub or shell that passes verification; raises queue.Empty.

        Kernel output is untrusted: code in the kernel holds its key but may also send garbage
        or mis-signed frames on its own sockets. Those are dropped and logged, never raised
        into the execute path (where they would fail the caller's request)."""
        assert self._client is not None
        get = self._client.get_iopub_msg if channel == "iopub" else self._client.get_shell_msg
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await get(timeout=max(deadline - time.monotonic(), 0))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
                log.warning(
                    "dropped a %s message that failed verification: %s",
                    channel,
                    str(err)[:200],
                    extra={"session": self.id},
                )
                if time.monotonic() >= deadline:
                    raise queue.Empty from None

    async def _collect(self, msg_id: str, collector: OutputCollector, deadline: float, epoch: int) -> ExecutionStatus:
        """Feed iopub messages of ``msg_id`` to the collector until the kernel is idle.

        Returns OK (idle seen), TIMEOUT (deadline passed) or KERNEL_DIED (watchdog).
        """
        assert self._client is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ExecutionStatus.TIMEOUT
            try:
                msg = await self._next_message("iopub", min(remaining, WATCHDOG_INTERVAL))
            except queue.Empty:
                if epoch != self._epoch or not await self._km.is_alive():
                    return ExecutionStatus.KERNEL_DIED
                if await self._reply_arrived(msg_id):
                    # The reply is final but iopub never said idle: dropped under flood, or the
                    # subscription itself was cut (an oversized message). Check, and repair.
                    if not await self._iopub_answers(IOPUB_PROBE_SECONDS, msg_id, collector):
                        await self._reconnect_iopub()
                        await collector.add(OUTPUT_LOST_NOTE)
                    return ExecutionStatus.OK
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["header"]["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return ExecutionStatus.OK
            await collector.add(msg)

    async def _reply_arrived(self, msg_id: str) -> bool:
        """Whether the execute_reply for ``msg_id`` is waiting on shell (kept for _reply_status)."""
        assert self._client is not None
        while True:
            try:
                msg = await self._next_message("shell", 0)
            except queue.Empty:
                return False
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                self._early_reply = msg["content"]
                return True

    async def _reply_status(self, msg_id: str, collector: OutputCollector) -> ExecutionStatus:
        """Read the execute_reply for ``msg_id`` and classify the outcome."""
        assert self._client is not None
        deadline = time.monotonic() + REPLY_TIMEOUT
        reply: dict[str, Any] | None = self._early_reply
        self._early_reply = None
        while reply is None and time.monotonic() < deadline:
            try:
                msg = await self._next_message("shell", max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                reply = msg["content"]
                break
        if reply is not None and reply.get("execution_count") is not None:
            collector.execution_count = reply["execution_count"]
        failed = (reply or {}).get("status") == "error" or collector.error is not None
        if not failed:
            return ExecutionStatus.OK
        if self._interrupt_requested and collector.error and collector.error.name == "KeyboardInterrupt":
            return ExecutionStatus.INTERRUPTED
        return ExecutionStatus.ERROR

    async def _stop_runaway(self, msg_id: str, collector: OutputCollector, timeout: float) -> TimeoutStep:
        """The ladder: interrupt, wait the grace period, restart the kernel, replace the container."""
        grace = self.profile.interrupt_grace
        reason = f"execution exceeded its {timeout:g}s timeout"
        with contextlib.suppress(RuntimeError, SandkernelError):
            await self._km.interrupt_kernel()
            epoch = self._epoch
            if await self._collect(msg_id, collector, time.monotonic() + grace, epoch) is ExecutionStatus.OK:
                await self._reply_status(msg_id, collector)
                log.info("timeout ended by interrupt", extra={"session": self.id})
                return TimeoutStep.INTERRUPT
        try:
            step = await asyncio.wait_for(
                self._restart_kernel(f"the kernel was restarted because the {reason}"),
                timeout=self.profile.start_timeout + grace,
            )
        except (asyncio.TimeoutError, SandkernelError, RuntimeError) as err:
            log.warning("restart failed, replacing the container: %s", err, extra={"session": self.id})
            await self._replace_kernel(f"the container was replaced because the {reason}")
            step = TimeoutStep.KILL
        log.info("timeout ended by %s", step.value, extra={"session": self.id})
        return step

    async def _replace_kernel(self, reason: str) -> None:
        """Last rung: throw away the kernel manager and container, start from scratch."""
        self._epoch += 1
        await self._teardown()
        self._oom_baseline = None
        self._km = self._new_kernel_manager(self._km.kernel_name)
        self._client = None
        await self._start_kernel()
        self._pending_state_lost = reason + "; variables, imports and /workspace files are gone"
        self._notes.append(self._pending_state_lost)

    async def _death_status(self, oom_before: int | None) -> ExecutionStatus:
        """KERNEL_DIED, or OOM when the container's OOM-kill counter moved."""
        try:
            if await self.container.oom_killed():
                return ExecutionStatus.OOM
            after = await self.container.oom_kill_count()
        except SandkernelError:
            return ExecutionStatus.KERNEL_DIED
        if after is not None and after > (oom_before if oom_before is not None else 0):
            self._oom_baseline = after
            return ExecutionStatus.OOM
        return ExecutionStatus.KERNEL_DIED

    def _death_sentence(self, status: ExecutionStatus, between_executes: bool) -> str:
        when = "between executions" if between_executes else "during this execution"
        if status is ExecutionStatus.OOM:
            return f"the kernel ran out of memory (limit {self.profile.memory_mb} MiB) {when} and was restarted"
        return f"the kernel died {when} and was restarted"


def _is_our_output(frames: list[zmq.Frame], our_session: str) -> bool:
    """Whether a raw iopub message is output answering one of our own requests. Only the small
    header frames are parsed (never the content); a message that does not parse is not ours."""
    try:
        delim = next(i for i, frame in enumerate(frames) if len(frame) == 9 and frame.bytes == b"<IDS|MSG>")
        header, parent = frames[delim + 2], frames[delim + 3]
        if len(header) > 65536 or len(parent) > 65536:
            return False
        msg_type = json.loads(header.bytes).get("msg_type")
        return msg_type in OUTPUT_MSG_TYPES and json.loads(parent.bytes).get("session") == our_session
    except (StopIteration, IndexError, ValueError, AttributeError):
        return False
