"""Output budgets: what an execute reply may carry, so one cell cannot flood a model's context.

Text (streams, text/plain, errors' tracebacks are left whole) is capped at ``max_text_bytes`` per
reply: outputs are kept in order until the budget runs out; the output that crosses it keeps
its head and tail around a marker saying how much was cut; later text outputs are replaced by
a marker. Images beyond ``max_images`` or ``max_image_bytes`` are replaced by a one-line
summary, and images the session layer already replaced by a marker (over the execution's byte
budget, see kernels/execution/outputs.py) count as omitted too. The reply says what was cut; the transcript
keeps more (within its own cap).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from sandkernel.kernels.execution.outputs import cut_marker

IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


@dataclasses.dataclass(frozen=True)
class OutputBudget:
    max_text_bytes: int = 64 * 1024
    max_images: int = 8
    max_image_bytes: int = 2 * 1024 * 1024


def clip_text(text: str, keep: int) -> tuple[str, int, int]:
    """Keep at most ``keep`` bytes of ``text`` (head and tail halves around a marker).

    Returns the new text, the bytes of the original kept, and the bytes cut.
    """
    raw = text.encode()
    if len(raw) <= keep:
        return text, len(raw), 0
    head = raw[: keep // 2].decode(errors="ignore")
    tail = raw[len(raw) - keep // 2 :].decode(errors="ignore") if keep // 2 else ""
    kept = len(head.encode()) + len(tail.encode())
    return head + cut_marker(len(raw) - kept, "bytes") + tail, kept, len(raw) - kept


def _replaced(output: dict[str, Any]) -> list[dict[str, Any]]:
    """What the session layer replaced by markers in this output (``metadata.sandkernel.omitted``).
    Metadata comes from the kernel too, so anything of another shape is ignored."""
    metadata = output.get("metadata")
    ours = metadata.get("sandkernel") if isinstance(metadata, dict) else None
    omitted = ours.get("omitted") if isinstance(ours, dict) else None
    return [entry for entry in omitted if isinstance(entry, dict)] if isinstance(omitted, list) else []


def apply_budget(outputs: list[dict[str, Any]], budget: OutputBudget) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return budgeted copies of ``outputs`` and a summary of what was cut."""
    remaining = budget.max_text_bytes
    text_cut = 0
    images_seen = 0
    images_omitted = 0
    replaced_bytes = 0  # replaced by markers in the session layer already
    result = []

    def clip(value: str) -> str:
        nonlocal remaining, text_cut
        clipped, kept, cut = clip_text(value, remaining)
        remaining -= kept
        text_cut += cut
        return clipped

    for original in outputs:
        output = copy.deepcopy(original)
        if output["output_type"] == "stream":
            output["text"] = clip(output["text"])
        elif output["output_type"] in ("display_data", "execute_result"):
            data = output.get("data", {})
            for entry in _replaced(output):
                images_omitted += entry.get("mime") in IMAGE_TYPES
                replaced_bytes += entry["bytes"] if isinstance(entry.get("bytes"), int) else 0
            for mime in IMAGE_TYPES:
                if mime in data:
                    images_seen += 1
                    size = len(data[mime]) if isinstance(data[mime], str) else 0
                    if images_seen > budget.max_images or size > budget.max_image_bytes:
                        del data[mime]
                        images_omitted += 1
                        note = f"[sandkernel: {mime} of {size} bytes omitted: over the budget]"
                        plain = data.get("text/plain")
                        data["text/plain"] = f"{plain}\n{note}" if isinstance(plain, str) and plain else note
            for mime, value in list(data.items()):
                if mime.startswith("text/") and isinstance(value, str):
                    data[mime] = clip(value)
        result.append(output)
    truncation = {
        "truncated": bool(text_cut or images_omitted or replaced_bytes),
        "text_bytes_cut": text_cut,
        "images_omitted": images_omitted,
        "max_text_bytes": budget.max_text_bytes,
    }
    return result, truncation
