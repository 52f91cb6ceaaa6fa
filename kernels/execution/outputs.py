"""Results of an execution, in nbformat output shape, shared by every layer.

The session layer builds an :class:`ExecutionResult` from the kernel's iopub messages with
:class:`OutputCollector`; the gateway serialises it, the recorder turns it into a notebook
cell, the client and agent read it. One shape everywhere, so a result looks the same
whichever door the code came through.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from sandkernel.output_text import readable_text
from sandkernel.truncation import cut_marker  # the one marker (also imported from here by older callers)

OutputCallback = Callable[[dict[str, Any]], Awaitable[None]]


class ExecutionStatus(str, enum.Enum):
    """How an execution ended. ``error`` is an exception in the user's code (data, not a failure)."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    KERNEL_DIED = "kernel_died"
    OOM = "oom"
    # The gateway stopped (restart, upgrade) while the code ran: the caller got what was produced
    # so far; the code itself kept running in the kernel, and the next gateway records its end.
    DETACHED = "detached"
    # A gate (the operator's execution policy, a session's circuit breaker) refused the code
    # before it reached the kernel: nothing ran. ``refusal`` says who, which rule and why.
    REFUSED = "refused"
    # A restart a client asked for (any door: the session API, the kernel API, MCP) ended the
    # code: nobody's code failed. ``state_lost`` says who asked; variables and imports are gone.
    RESTARTED = "restarted"
    # The session was deleted (by its tenant, its lifetime, the gateway's stop) while the code
    # ran: the caller gets the outputs so far, and the sandbox is gone.
    DELETED = "deleted"


class TimeoutStep(str, enum.Enum):
    """What ended an execution before its code finished: a rung of the timeout ladder, or the
    gateway letting go of the session as it stopped (``ended_by: "gateway_restart"``)."""

    INTERRUPT = "interrupt"
    RESTART = "restart"
    KILL = "kill"
    GATEWAY_RESTART = "gateway_restart"


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    name: str
    value: str
    traceback: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    """What one ``execute`` produced. Times are seconds; ``started_at`` is ISO 8601 UTC.

    ``state_lost`` says, in a sentence, why the kernel's memory state was lost at or before
    this execution (restart after a timeout, an OOM kill, a crash), or is None.
    """

    status: ExecutionStatus
    outputs: tuple[dict[str, Any], ...]
    execution_count: int | None
    started_at: str
    duration: float
    error: ErrorInfo | None = None
    ended_by: TimeoutStep | None = None
    state_lost: str | None = None
    chars_cut: int = 0  # stream text cut to bound memory (see OutputCollector)
    outputs_dropped: int = 0
    bytes_omitted: int = 0  # rich output replaced by markers over the execution's byte budget
    # What the cell cost, measured on the host (CellMeter: CPU, peak memory, files, egress,
    # packages); None when accounting is off or the code never ran.
    accounting: dict[str, Any] | None = None
    # The execution policy's findings: {"rule", "action": "warn"|"deny", "message", "line"}.
    policy: tuple[dict[str, Any], ...] = ()
    # Why the code did not run (status ``refused``): {"by": "policy"|"breaker", "rule", "message"}.
    refusal: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """Everything a person would read: stdout, stderr and text/plain results, in order."""
        return readable_text(self.outputs)

    def to_dict(self) -> dict[str, Any]:
        """JSON: every field, in field order. Written out rather than ``dataclasses.asdict``,
        which deep-copies every output only for the copy to be replaced (it was a tenth of a
        trivial execute's gateway CPU): outputs and policy findings are the result's own dicts
        in new lists, as before; accounting and refusal are copied."""
        error = self.error
        return {
            "status": self.status.value,
            "outputs": list(self.outputs),
            "execution_count": self.execution_count,
            "started_at": self.started_at,
            "duration": self.duration,
            "error": (
                {"name": error.name, "value": error.value, "traceback": list(error.traceback)} if error else None
            ),
            "ended_by": self.ended_by.value if self.ended_by else None,
            "state_lost": self.state_lost,
            "chars_cut": self.chars_cut,
            "outputs_dropped": self.outputs_dropped,
            "bytes_omitted": self.bytes_omitted,
            "accounting": _copied(self.accounting),
            "policy": list(self.policy),
            "refusal": _copied(self.refusal),
        }


def _copied(value: Any) -> Any:
    """A copy of JSON-like ``value`` (dicts, lists and tuples rebuilt, as ``dataclasses.asdict``
    does; other objects deep-copied), so a caller may change what :meth:`ExecutionResult.to_dict`
    gave it."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copied(v) for v in value)
    if value is None or isinstance(value, (str, int, float)):
        return value
    return copy.deepcopy(value)


REFUSED_ENAME = "ExecutionRefused"


def refused_result(refusal: dict[str, Any], findings: tuple[dict[str, Any], ...], started_at: str) -> ExecutionResult:
    """The result of an execution a gate refused: one error output carrying the message (so a
    model, JupyterLab and the transcript all read why), no execution count, nothing ran."""
    message = str(refusal.get("message", "the execution was refused"))
    output = {"output_type": "error", "ename": REFUSED_ENAME, "evalue": message, "traceback": [message]}
    return ExecutionResult(
        status=ExecutionStatus.REFUSED,
        outputs=(output,),
        execution_count=None,
        started_at=started_at,
        duration=0.0,
        error=ErrorInfo(REFUSED_ENAME, message, (message,)),
        policy=findings,
        refusal=dict(refusal),
    )


# What one execution may hold in memory, whatever the code prints: a cell printing 1 GB must
# not grow the host process. Streams keep their head and tail around a marker.
MAX_STREAM_CHARS = 2 * 1024 * 1024
MAX_OUTPUTS = 2000
# Bytes of output (rich MIME data, tracebacks and stream text) one execution may hold in the host.
# Outputs past it are replaced by a marker naming their size and SHA-256. 48 MiB keeps a 30 MiB
# image whole (40 MiB as base64, which the reply budget then summarises) while a kernel that
# displays 60 MB blobs in a loop holds at most this much per execution in the gateway.
MAX_OUTPUT_BYTES = 48 * 1024 * 1024
# A MIME value, stream or traceback at most this long is never replaced by a marker (bytes): a
# marker would not be shorter, and the short text/plain of a figure stays readable.
MARKER_ABOVE_BYTES = 1024
# The reason the markers give for output the execution's byte budget replaced.
OVER_BUDGET = "over the execution's output budget"


def value_size(value: Any) -> int:
    """Bytes of one output value as nbformat stores it (UTF-8 text, or JSON for JSON MIME types)."""
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode())
    if isinstance(value, list):  # multiline strings, tracebacks
        return sum(value_size(v) for v in value)
    return len(json.dumps(value, default=str))


def _digest(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = "".join(value)
    raw = value.encode() if isinstance(value, str) else json.dumps(value, default=str).encode()
    return hashlib.sha256(raw).hexdigest()


def output_size(output: dict[str, Any]) -> int:
    """Bytes of the content of one nbformat output (what a marker would replace)."""
    kind = output.get("output_type")
    if kind == "stream":
        return value_size(output.get("text", ""))
    if kind == "error":
        return sum(value_size(output.get(key, "")) for key in ("traceback", "evalue", "ename"))
    metadata = output.get("metadata")  # the kernel's too: as large as it likes unless counted
    return sum(value_size(v) for v in (output.get("data") or {}).values()) + (value_size(metadata) if metadata else 0)


def replace_with_markers(output: dict[str, Any], why: str) -> int:
    """Replace the large parts of one nbformat output, in place, by markers (size, SHA-256).

    Rich outputs keep their small MIME values and get a text/plain marker per replaced value
    (their metadata, which the kernel sends too, is replaced whole when large);
    ``metadata.sandkernel.omitted`` lists what was replaced (MIME type, bytes, sha256), so the
    reply budget and readers can tell. Streams and tracebacks become their marker. The output
    stays valid nbformat. Returns the bytes replaced.
    """
    kind = output.get("output_type")
    omitted: list[dict[str, Any]] = []
    if kind == "stream":
        text = output.get("text", "")
        size = value_size(text)
        if size <= MARKER_ABOVE_BYTES:
            return 0
        output["text"] = cut_marker(size, "bytes", output.get("name", "stream"), why, _digest(text))
        return size
    if kind == "error":
        cut = 0
        size = value_size(output.get("traceback", []))
        if size > MARKER_ABOVE_BYTES:
            output["traceback"] = [cut_marker(size, "bytes", "traceback", why, _digest(output["traceback"]))]
            cut += size
        for key, what in (("evalue", "error value"), ("ename", "error name")):
            size = value_size(output.get(key, ""))
            if size > MARKER_ABOVE_BYTES:
                output[key] = cut_marker(size, "bytes", what, why, _digest(output[key]))
                cut += size
        return cut
    data = output.get("data") or {}
    notes = []
    metadata = output.get("metadata")
    size = value_size(metadata) if metadata else 0
    if size > MARKER_ABOVE_BYTES:  # the kernel's metadata, replaced whole (any "omitted" it forged goes too)
        digest = _digest(metadata)
        output["metadata"] = {}
        omitted.append({"mime": "metadata", "bytes": size, "sha256": digest})
        notes.append(cut_marker(size, "bytes", "metadata", why, digest))
    for mime, value in list(data.items()):
        size = value_size(value)
        if size > MARKER_ABOVE_BYTES:
            digest = _digest(value)
            del data[mime]
            omitted.append({"mime": mime, "bytes": size, "sha256": digest})
            notes.append(cut_marker(size, "bytes", mime, why, digest))
    if not omitted:
        return 0
    plain = data.get("text/plain")
    plain = "".join(plain) if isinstance(plain, list) else plain
    data["text/plain"] = (plain or "") + "".join(notes)
    output["data"] = data
    metadata = output.setdefault("metadata", {})
    metadata.setdefault("sandkernel", {}).setdefault("omitted", []).extend(omitted)
    return sum(o["bytes"] for o in omitted)


JSON_MIME = re.compile(r"^application/(.*\+)?json$")


def output_from_content(msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
    """The nbformat v4 output of an iopub message of ``msg_type`` (stream, display_data,
    execute_result, error), shaped so that it is always valid nbformat.

    nbformat's own ``output_from_msg`` validates every output against the schema (0.3 ms each:
    a print loop of 100,000 lines spent 30 s in it) and raises on a malformed message. Kernel
    output is untrusted, so here every field is coerced to the type the schema wants instead:
    a hostile kernel cannot fail an execution or invalidate the transcript."""
    if msg_type == "stream":
        return {
            "output_type": "stream",
            "name": _string(content.get("name"), "stdout"),
            "text": _text(content.get("text")),
        }
    if msg_type == "error":
        traceback = content.get("traceback")
        return {
            "output_type": "error",
            "ename": _string(content.get("ename"), "Error"),
            "evalue": _string(content.get("evalue"), ""),
            "traceback": [_text(line) for line in traceback] if isinstance(traceback, list) else [],
        }
    output: dict[str, Any] = {"output_type": msg_type, "data": _mime_bundle(content.get("data"))}
    output["metadata"] = content["metadata"] if isinstance(content.get("metadata"), dict) else {}
    if msg_type == "execute_result":
        count = content.get("execution_count")
        output["execution_count"] = count if isinstance(count, int) and not isinstance(count, bool) else None
    return output


def _string(value: Any, default: str) -> str:
    return value if isinstance(value, str) else default


def _text(value: Any) -> str:
    """A multiline string: a str, or a list of str joined; anything else as JSON text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, str) for part in value):
        return "".join(value)
    return "" if value is None else json.dumps(value, default=str)


def _mime_bundle(data: Any) -> dict[str, Any]:
    """A MIME bundle: JSON types keep any JSON value, every other type becomes text."""
    if not isinstance(data, dict):
        return {}
    return {str(mime): value if JSON_MIME.match(str(mime)) else _text(value) for mime, value in data.items()}


class OutputCollector:
    """Turns the iopub messages of one execution into ordered nbformat outputs.

    Consecutive stream chunks of the same name are merged (as JupyterLab shows them);
    ``clear_output`` (with or without ``wait``) and ``update_display_data`` are honoured.
    Memory is bounded in bytes: each merged stream keeps at most ``max_stream_chars`` (head and
    tail halves); at most ``max_outputs`` outputs are kept; and all outputs together hold at
    most ``max_bytes`` (plus one stream's bound, as a stream grows by merging): past it, a rich
    output or traceback keeps a marker with its size and SHA-256 and a new stream is dropped. What was cut is counted in
    ``chars_cut`` / ``outputs_dropped`` / ``bytes_omitted``.
    """

    def __init__(
        self,
        on_output: OutputCallback | None = None,
        max_stream_chars: int = MAX_STREAM_CHARS,
        max_outputs: int = MAX_OUTPUTS,
        max_bytes: int = MAX_OUTPUT_BYTES,
    ) -> None:
        self.on_output = on_output
        self.outputs: list[dict[str, Any]] = []
        self.execution_count: int | None = None
        self.error: ErrorInfo | None = None
        self.max_stream_chars = max_stream_chars
        self.max_outputs = max_outputs
        self.max_bytes = max_bytes
        self.bytes_held = 0  # bytes of the outputs kept (see output_size)
        self.chars_cut = 0
        self.outputs_dropped = 0
        self.bytes_omitted = 0
        self._clear_before_next = False

    async def add(self, msg: dict[str, Any]) -> None:
        """Record one iopub message; awaits the streaming callback for real outputs."""
        output = self._record(msg)
        if output is not None and self.on_output is not None:
            await self.on_output({k: v for k, v in output.items() if not k.startswith("_")})

    def _clear(self) -> None:
        self.outputs.clear()
        self.bytes_held = 0

    def _fit(self, output: dict[str, Any], size: int) -> int:
        """Keep ``output`` within the byte budget (markers past it); returns the bytes it holds."""
        if self.bytes_held + size <= self.max_bytes:
            return size
        cut = replace_with_markers(output, OVER_BUDGET)
        self.bytes_omitted += cut
        return output_size(output) if cut else size

    def _record(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        msg_type = msg["header"]["msg_type"]
        content = msg["content"]
        if msg_type == "execute_input":
            self.execution_count = content.get("execution_count")
            return None
        if msg_type == "clear_output":
            if content.get("wait"):
                self._clear_before_next = True
            else:
                self._clear()
            return None
        if msg_type == "update_display_data":
            display_id = content.get("transient", {}).get("display_id")
            for output in self.outputs:
                if display_id and output.get("_display_id") == display_id:
                    self.bytes_held -= output.get("_bytes", 0)
                    output["data"] = dict(content.get("data", {}))
                    output["metadata"] = dict(content.get("metadata", {}))
                    output["_bytes"] = self._fit(output, output_size(output))
                    self.bytes_held += output["_bytes"]
            return None
        if msg_type not in ("stream", "display_data", "execute_result", "error"):
            return None
        if self._clear_before_next:
            self._clear()
            self._clear_before_next = False
        output = output_from_content(msg_type, content)
        if msg_type == "execute_result":
            self.execution_count = content.get("execution_count", self.execution_count)
        display_id = content.get("transient", {}).get("display_id")
        if display_id:
            output["_display_id"] = display_id
        last = self.outputs[-1] if self.outputs else None
        if msg_type == "stream" and last and last["output_type"] == "stream" and last["name"] == output["name"]:
            self._append_stream(last, output["text"])
        elif len(self.outputs) >= self.max_outputs:
            self.outputs_dropped += 1
            if msg_type == "error":  # kept only as the execution's error: bounded all the same
                self.bytes_omitted += replace_with_markers(output, OVER_BUDGET)
        elif msg_type == "stream":
            if self.bytes_held + len(output["text"]) > self.max_bytes:
                self.outputs_dropped += 1
                self.chars_cut += len(output["text"])
                return output
            text, output["text"] = output["text"], ""
            self._append_stream(output, text)
            self.outputs.append(output)
        else:
            output["_bytes"] = self._fit(output, output_size(output))
            self.bytes_held += output["_bytes"]
            self.outputs.append(output)
        if msg_type == "error":
            self.error = ErrorInfo(output["ename"], output["evalue"], tuple(output["traceback"]))
        return output

    def _append_stream(self, stream: dict[str, Any], text: str) -> None:
        """Append to a stream output, keeping a fixed head and a bounded tail."""
        before = len(stream["text"])
        self._merge_stream(stream, text)
        self.bytes_held += len(stream["text"]) - before

    def _merge_stream(self, stream: dict[str, Any], text: str) -> None:
        half = self.max_stream_chars // 2
        head_len = stream.get("_head_len")
        if head_len is None:
            combined = stream["text"] + text
            if len(combined) <= self.max_stream_chars:
                stream["text"] = combined
                return
            stream["_head_len"] = head_len = half
            stream["text"], text = combined[:half], combined[half:]
        tail = stream["text"][head_len:] + text
        if len(tail) > half:
            cut = len(tail) - half
            stream["_cut"] = stream.get("_cut", 0) + cut
            self.chars_cut += cut
            tail = tail[cut:]
        stream["text"] = stream["text"][:head_len] + tail

    def finished_outputs(self) -> tuple[dict[str, Any], ...]:
        """The outputs with cut markers in place and internal bookkeeping keys removed."""
        finished = []
        for out in self.outputs:
            clean = {k: v for k, v in out.items() if not k.startswith("_")}
            if out.get("_cut"):
                head_len = out["_head_len"]
                clean["text"] = out["text"][:head_len] + cut_marker(out["_cut"]) + out["text"][head_len:]
            finished.append(clean)
        return tuple(finished)
