"""Output budgets: what an execute reply may carry, so one cell cannot flood a model's context.

Every MIME value is one of two kinds, decided by :func:`sandkernel.mime.is_text` (one answer for
the whole code base): text-like values (streams, text/*, JSON, JavaScript, ...) share
``max_text_bytes`` per reply; everything else (images, PDFs, video, any type nobody listed) is
binary and counts against the image budget: at most ``max_images`` values, each at most
``max_image_bytes``. An unknown type is binary, so it cannot escape both budgets by being unknown.

Text is kept in order until the budget runs out; the value that crosses it keeps its head and tail
around the one cut marker (:mod:`sandkernel.truncation`); later text is dropped and counted (one
marker per crossing, not one per later value, so a million tiny outputs cannot grow the reply by
a marker each). A JSON value (a dict, not a string) is kept whole or replaced by a marker, never
cut into invalid JSON. Binary values past the image budget are replaced by a marker in text/plain
(while the text budget has room for it; the summary counts them either way).
Values the session layer already replaced by markers (over the execution's byte budget, see
kernels/execution/outputs.py) count as cut too. Error tracebacks are left whole (the collector
bounds them). The reply says what was cut; the transcript keeps more (within its own cap).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from sandkernel.kernels.execution.outputs import value_size
from sandkernel.mime import is_binary, is_text
from sandkernel.truncation import clip_text, cut_marker

REPLY_TEXT_BUDGET = "over the reply's text budget"
REPLY_IMAGE_BUDGET = "omitted from this reply: over its image budget"


@dataclasses.dataclass(frozen=True)
class OutputBudget:
    """Per-reply limits: text bytes (UTF-8) shared by all text-like values; count and bytes per
    binary value (images and any other non-text type)."""

    max_text_bytes: int = 64 * 1024
    max_images: int = 8
    max_image_bytes: int = 2 * 1024 * 1024


def _replaced(output: dict[str, Any]) -> list[dict[str, Any]]:
    """What the session layer replaced by markers in this output (``metadata.sandkernel.omitted``).
    Metadata comes from the kernel too, so anything of another shape is ignored."""
    metadata = output.get("metadata")
    ours = metadata.get("sandkernel") if isinstance(metadata, dict) else None
    omitted = ours.get("omitted") if isinstance(ours, dict) else None
    return [entry for entry in omitted if isinstance(entry, dict)] if isinstance(omitted, list) else []


class _Reply:
    """The running totals of one :func:`apply_budget` call."""

    def __init__(self, budget: OutputBudget) -> None:
        self.budget = budget
        self.remaining = budget.max_text_bytes
        self.text_cut = 0
        self.binaries_seen = 0
        self.images_omitted = 0
        self.replaced_bytes = 0
        self.marked = False  # a text marker was written: later text is dropped without one

    def text(self, value: str) -> str | None:
        """``value`` within what is left of the text budget; None once the budget is spent."""
        if not value:
            return value
        if self.remaining <= 0:
            self.text_cut += value_size(value)
            if self.marked:
                return None
            self.marked = True  # the budget ran out exactly at a value's end: say so once
            return cut_marker(None, what="the rest of the output", why=REPLY_TEXT_BUDGET)
        clipped = clip_text(value, self.remaining, why=REPLY_TEXT_BUDGET)
        self.remaining = 0 if clipped.cut else self.remaining - clipped.kept
        self.marked = self.marked or clipped.truncated
        self.text_cut += clipped.cut
        return clipped.text

    def json(self, mime: str, value: Any) -> tuple[Any, str | None]:
        """A JSON value whole, or None and a marker (JSON cut in the middle would not parse)."""
        size = value_size(value)
        if size <= self.remaining:
            self.remaining -= size
            return value, None
        self.text_cut += size  # replaced whole, so the budget left stays for the rest
        return None, cut_marker(size, "bytes", mime, REPLY_TEXT_BUDGET) if self.remaining > 0 else None

    def binary(self, mime: str, value: Any) -> str | None:
        """None when ``value`` fits the image budget, else the marker that replaces it."""
        self.binaries_seen += 1
        size = value_size(value)
        if self.binaries_seen <= self.budget.max_images and size <= self.budget.max_image_bytes:
            return None
        self.images_omitted += 1
        return cut_marker(size, "bytes", mime, REPLY_IMAGE_BUDGET)


def _rich(output: dict[str, Any], reply: _Reply) -> None:
    """Budget one display_data / execute_result in place."""
    for entry in _replaced(output):
        mime = entry.get("mime")
        reply.images_omitted += isinstance(mime, str) and is_binary(mime) and mime != "metadata"
        reply.replaced_bytes += entry["bytes"] if isinstance(entry.get("bytes"), int) else 0
    data = output.get("data")
    if not isinstance(data, dict):
        return
    notes = []
    for mime in [m for m in data if not is_text(m)]:  # binaries first: their markers are text
        note = reply.binary(mime, data[mime])
        if note is not None:
            del data[mime]
            notes.append(note)
    # text/plain first: every front-end (and the model) falls back to it
    for mime in sorted((m for m in data if is_text(m)), key=lambda m: m != "text/plain"):
        value = data[mime]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = "".join(value)  # nbformat's multiline form
        if isinstance(value, str):
            kept = reply.text(value)
        else:
            kept, note = reply.json(mime, value)
            notes += [note] if note else []
        if kept is None:
            del data[mime]
        else:
            data[mime] = kept
    note = "".join(notes)
    if note and value_size(note) <= reply.remaining:  # markers count against the text budget too
        reply.remaining -= value_size(note)
        plain = data.get("text/plain")
        data["text/plain"] = f"{plain}{note}" if isinstance(plain, str) and plain else note.strip("\n")


def apply_budget(outputs: list[dict[str, Any]], budget: OutputBudget) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return budgeted copies of ``outputs`` (in order, none dropped) and a summary of what was cut.

    Callers: the execute reply and its streaming form (gateway/sessions_api.py). The summary's
    ``truncated`` is True when anything was cut here or by the session layer's markers;
    ``images_omitted`` counts binary values of every type (not only images); ``text_bytes_cut``
    counts text bytes.
    """
    reply = _Reply(budget)
    result = []
    for original in outputs:
        output = copy.deepcopy(original)
        kind = output.get("output_type")
        if kind == "stream":
            text = output.get("text", "")
            output["text"] = reply.text("".join(text) if isinstance(text, list) else str(text)) or ""
        elif kind in ("display_data", "execute_result"):
            _rich(output, reply)
        result.append(output)
    truncation = {
        "truncated": bool(reply.text_cut or reply.images_omitted or reply.replaced_bytes),
        "text_bytes_cut": reply.text_cut,
        "images_omitted": reply.images_omitted,
        "max_text_bytes": budget.max_text_bytes,
    }
    return result, truncation
