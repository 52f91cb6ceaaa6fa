"""Results of an execution, in nbformat output shape, shared by every layer.

The session layer builds an :class:`ExecutionResult` from the kernel's iopub messages with
:class:`OutputCollector`; the gateway serialises it, the recorder turns it into a notebook
cell, the client and agent read it. One shape everywhere, so a result looks the same
whichever door the code came through.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable
from typing import Any

from nbformat.v4 import output_from_msg

OutputCallback = Callable[[dict[str, Any]], Awaitable[None]]


class ExecutionStatus(str, enum.Enum):
    """How an execution ended. ``error`` is an exception in the user's code (data, not a failure)."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    KERNEL_DIED = "kernel_died"
    OOM = "oom"


class TimeoutStep(str, enum.Enum):
    """Which rung of the timeout ladder stopped the code."""

    INTERRUPT = "interrupt"
    RESTART = "restart"
    KILL = "kill"


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

    @property
    def text(self) -> str:
        """Everything a person would read: stdout, stderr and text/plain results, in order."""
        parts = []
        for output in self.outputs:
            if output["output_type"] == "stream":
                parts.append(output["text"])
            elif output["output_type"] in ("execute_result", "display_data"):
                plain = output.get("data", {}).get("text/plain")
                if plain:
                    parts.append(plain if plain.endswith("\n") else plain + "\n")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["ended_by"] = self.ended_by.value if self.ended_by else None
        data["outputs"] = list(self.outputs)
        if self.error:
            data["error"]["traceback"] = list(self.error.traceback)
        return data


# What one execution may hold in memory, whatever the code prints: a cell printing 1 GB must
# not grow the host process. Streams keep their head and tail around a marker.
MAX_STREAM_CHARS = 2 * 1024 * 1024
MAX_OUTPUTS = 2000


def cut_marker(cut: int) -> str:
    return f"\n…[sandkernel: {cut} characters of output cut here]…\n"


class OutputCollector:
    """Turns the iopub messages of one execution into ordered nbformat outputs.

    Consecutive stream chunks of the same name are merged (as JupyterLab shows them);
    ``clear_output`` (with or without ``wait``) and ``update_display_data`` are honoured.
    Memory is bounded: each merged stream keeps at most ``max_stream_chars`` (head and tail
    halves), and at most ``max_outputs`` outputs are kept; the rest is counted in
    ``chars_cut`` / ``outputs_dropped``.
    """

    def __init__(
        self,
        on_output: OutputCallback | None = None,
        max_stream_chars: int = MAX_STREAM_CHARS,
        max_outputs: int = MAX_OUTPUTS,
    ) -> None:
        self.on_output = on_output
        self.outputs: list[dict[str, Any]] = []
        self.execution_count: int | None = None
        self.error: ErrorInfo | None = None
        self.max_stream_chars = max_stream_chars
        self.max_outputs = max_outputs
        self.chars_cut = 0
        self.outputs_dropped = 0
        self._clear_before_next = False

    async def add(self, msg: dict[str, Any]) -> None:
        """Record one iopub message; awaits the streaming callback for real outputs."""
        output = self._record(msg)
        if output is not None and self.on_output is not None:
            await self.on_output({k: v for k, v in output.items() if not k.startswith("_")})

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
                self.outputs.clear()
            return None
        if msg_type == "update_display_data":
            display_id = content.get("transient", {}).get("display_id")
            for output in self.outputs:
                if display_id and output.get("_display_id") == display_id:
                    output["data"] = content.get("data", {})
                    output["metadata"] = content.get("metadata", {})
            return None
        if msg_type not in ("stream", "display_data", "execute_result", "error"):
            return None
        if self._clear_before_next:
            self.outputs.clear()
            self._clear_before_next = False
        output = dict(output_from_msg(msg))
        if msg_type == "execute_result":
            self.execution_count = content.get("execution_count", self.execution_count)
        if msg_type == "error":
            self.error = ErrorInfo(
                content.get("ename", ""), content.get("evalue", ""), tuple(content.get("traceback", []))
            )
        display_id = content.get("transient", {}).get("display_id")
        if display_id:
            output["_display_id"] = display_id
        last = self.outputs[-1] if self.outputs else None
        if msg_type == "stream" and last and last["output_type"] == "stream" and last["name"] == output["name"]:
            self._append_stream(last, output["text"])
        elif len(self.outputs) >= self.max_outputs:
            self.outputs_dropped += 1
        else:
            if msg_type == "stream":
                text, output["text"] = output["text"], ""
                self._append_stream(output, text)
            self.outputs.append(output)
        return output

    def _append_stream(self, stream: dict[str, Any], text: str) -> None:
        """Append to a stream output, keeping a fixed head and a bounded tail."""
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
