"""The agent's tools, bound to one sandbox session, and how their results go back to the model.

Every tool call runs as code in the session's kernel (file tools included, as short readable
Python), so each one is a code cell of the transcript with its tool-use id, and replaying the
notebook replays the whole session. Results are bounded with sandkernel's one cut marker
(:mod:`sandkernel.truncation`, shared with the gateway but not imported from it);
images become image blocks; exceptions come back with ``is_error`` and a trimmed traceback.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from sandkernel.agent.client import AsyncSession
from sandkernel.agent.execution import Execution, GatewayRestarted
from sandkernel.agent.images import image_block
from sandkernel.truncation import clip_text, cut_marker

MAX_RESULT_BYTES = 16 * 1024
MAX_IMAGES_PER_RESULT = 4
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
GATEWAY_RESTARTED = "gateway_restarted"  # a tool call's status when its gateway went away mid-step
RESTART_NOTE = (
    "[sandkernel] The sandbox gateway restarted during this step, so this step may not have finished: "
    "the code may have run completely, partly, or not at all, and it may still be running in the kernel. "
    "The session's variables and files normally survive a gateway restart. Do not assume the step ran "
    "once or not at all: before running it again, check the state it should have left (for example "
    "whether a variable exists or a file was written)."
)

TOOLS: list[dict[str, Any]] = [
    {
        "name": "run_python",
        "description": (
            "Run Python code in a persistent IPython kernel inside a sandbox. Variables, imports and "
            "loaded data persist between calls, so build on earlier results instead of recomputing. "
            "The working directory is /workspace (the user's files are there). pandas, numpy and "
            "matplotlib are installed; figures shown with plt.show() come back to you as images. "
            "Shell commands work with a leading '!' (e.g. !ls -la). The sandbox has NO network access."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Python source to run"},
                "timeout": {"type": "number", "description": "seconds before the code is stopped (default 120)"},
            },
            "required": ["code"],
        },
    },
    {
        "name": "list_files",
        "description": "List files in a workspace directory (default: the workspace root).",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "directory relative to /workspace"}},
        },
    },
    {
        "name": "read_file",
        "description": "Read a text file from the workspace (long files are cut in the middle).",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string", "description": "file path relative to /workspace"}},
            "required": ["path"],
        },
    },
    {
        "name": "write_file",
        "description": "Write a text file in the workspace (parent directories are created).",
        "input_schema": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "file path relative to /workspace"},
                "content": {"type": "string", "description": "the whole file content"},
            },
            "required": ["path", "content"],
        },
    },
    {
        "name": "final_answer",
        "description": (
            "Finish the task: give the user your answer (what you found, which files you wrote). "
            "Also use it when the task cannot be done in this sandbox, saying why."
        ),
        "input_schema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "the answer, in markdown"}},
            "required": ["answer"],
        },
    },
]

FINAL_ANSWER = "final_answer"


def code_for(name: str, tool_input: dict[str, Any]) -> str:
    """The Python a tool call runs; written to leave no names behind in the user's namespace."""
    if name == "run_python":
        return str(tool_input.get("code", ""))
    path = repr(str(tool_input.get("path") or "."))
    if name == "list_files":
        return (
            f"# list_files({path})\n"
            f"print(*sorted(p.name + ('/' if p.is_dir() else '') "
            f"for p in __import__('pathlib').Path({path}).iterdir()), sep='\\n')"
        )
    if name == "read_file":
        return f"# read_file({path})\nprint(__import__('pathlib').Path({path}).read_text(errors='replace'), end='')"
    if name == "write_file":
        content = repr(str(tool_input.get("content", "")))
        return (
            f"# write_file({path})\n"
            f"__import__('pathlib').Path({path}).parent.mkdir(parents=True, exist_ok=True)\n"
            f"print(__import__('pathlib').Path({path}).write_text({content}), 'characters written to', {path})"
        )
    raise KeyError(name)


@dataclasses.dataclass
class ToolOutcome:
    """A tool call's result block for the model, and what the loop needs to judge progress."""

    block: dict[str, Any]
    status: str
    failure: str | None  # a short signature of the failure ("URLError"), None when it worked
    execution: Execution | None = None


async def run_tool(
    session: AsyncSession, tool_use_id: str, name: str, tool_input: dict[str, Any], default_timeout: float = 120.0
) -> ToolOutcome:
    if name not in {tool["name"] for tool in TOOLS} or name == FINAL_ANSWER:
        return ToolOutcome(_result(tool_use_id, f"unknown tool {name!r}", True), "error", f"unknown tool {name}")
    if name == "run_python" and not str(tool_input.get("code", "")).strip():
        return ToolOutcome(_result(tool_use_id, "run_python needs non-empty 'code'", True), "error", "empty code")
    timeout = tool_input.get("timeout") if name == "run_python" else None
    timeout = float(timeout) if isinstance(timeout, int | float) and timeout > 0 else default_timeout
    try:
        execution = await session.run(code_for(name, tool_input), timeout=timeout, tag=tool_use_id)
    except GatewayRestarted as restarted:
        return ToolOutcome(restart_block(tool_use_id, restarted), GATEWAY_RESTARTED, None, restarted.execution)
    return ToolOutcome(result_block(tool_use_id, execution), execution.status, failure_signature(execution), execution)


def restart_block(tool_use_id: str, restarted: GatewayRestarted) -> dict[str, Any]:
    """The tool_result for a step whose gateway went away: what it printed before, then why it
    may be incomplete. Not a failure of the model's approach (the re-plan counter ignores it)."""
    seen = ANSI.sub("", restarted.execution.text).strip() if restarted.execution else ""
    note = RESTART_NOTE
    if not restarted.came_back:
        note += " The gateway has not answered again yet: the next call may fail too."
    text = f"Output before the restart:\n{seen}\n\n{note}" if seen else note
    return _result(tool_use_id, clip_text(text, MAX_RESULT_BYTES, why="to fit the tool result").text, True)


def failure_signature(execution: Execution) -> str | None:
    if execution.ok:
        return None
    if execution.error:
        return execution.error.name
    return execution.status


def result_block(tool_use_id: str, execution: Execution) -> dict[str, Any]:
    """The tool_result block for one execution: bounded text, then images."""
    text = ANSI.sub("", execution.text)
    if execution.error:
        trace = ANSI.sub("", "\n".join(execution.error.traceback[-6:]))
        text += f"\n{trace}".rstrip() + "\n"
    if execution.status not in ("ok", "error"):
        text += f"\n[sandkernel: the execution ended as {execution.status}"
        text += f" ({execution.ended_by})" if execution.ended_by else ""
        text += f"; {execution.state_lost}]" if execution.state_lost else "]"
    if execution.truncated:
        text += cut_marker(None, what="output", why="to fit the gateway's reply; the session notebook has all of it")
    text = clip_text(text.strip() or "(no output)", MAX_RESULT_BYTES, why="to fit the tool result").text
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for image in execution.images[:MAX_IMAGES_PER_RESULT]:
        block = image_block(image)
        content.append(block if isinstance(block, dict) else {"type": "text", "text": block})
    return _result(tool_use_id, content, not execution.ok)


def _result(tool_use_id: str, content: str | list[dict[str, Any]], is_error: bool) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, "is_error": is_error}
