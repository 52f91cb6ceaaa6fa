"""Audit notes for websocket requests that run code but leave no cell of their own.

Silent executes, ``user_expressions`` and debugger requests that run code or change program
state are noted in the session's record (through the session's observers), clipped to a bounded
size with the one cut marker, inside a code fence the text cannot close early.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from sandkernel.kernels.execution.outputs import cut_marker

# Characters of code (or debugger arguments) an audit note keeps; the rest is cut with a marker.
NOTE_CODE_CHARS = 4096
# Debugger commands recorded: those that run code or change program state.
RECORDED_DEBUG_COMMANDS = frozenset(
    {"evaluate", "setExpression", "setVariable", "dumpCell", "copyToGlobals", "richInspectVariables"}
)


def clip_for_note(text: str) -> str:
    """At most NOTE_CODE_CHARS of ``text`` (head and tail), with the one cut marker and SHA-256."""
    if len(text) <= NOTE_CODE_CHARS:
        return text
    half = NOTE_CODE_CHARS // 2
    digest = hashlib.sha256(text.encode(errors="replace")).hexdigest()
    return text[:half] + cut_marker(len(text) - 2 * half, "characters", "code", sha256=digest) + text[-half:]


def fenced(text: str, language: str = "") -> str:
    """A markdown code block that ``text`` cannot close early (fence longer than any backtick run)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"


def execute_request_notes(content: dict[str, Any]) -> list[str]:
    """Notes for the hidden parts of an ``execute_request``: a silent execute's code, and any
    ``user_expressions`` (evaluated even by a normal execute, but shown in no output)."""
    notes = []
    code = str(content.get("code", ""))
    expressions = content.get("user_expressions")
    if content.get("silent") and code.strip():
        notes.append(
            "a websocket client ran a silent execute (no outputs recorded):\n\n" + fenced(clip_for_note(code), "python")
        )
    if isinstance(expressions, dict) and expressions:
        listing = "\n".join(f"{name} = {value}" for name, value in expressions.items())
        notes.append(
            "a websocket client evaluated `user_expressions` with an execute:\n\n"
            + fenced(clip_for_note(listing), "python")
        )
    return notes


def debug_request_note(content: dict[str, Any]) -> str | None:
    """A note for a debugger request that runs code or changes state (evaluate, setVariable, ...)."""
    command = content.get("command")
    if command not in RECORDED_DEBUG_COMMANDS:
        return None
    arguments = json.dumps(content.get("arguments", {}), ensure_ascii=False, default=str)
    return f"a websocket client sent the debugger `{command}`:\n\n" + fenced(clip_for_note(arguments), "json")
