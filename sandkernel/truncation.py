"""Truncation with one marker: how sandkernel cuts text, and the one sentence that says it did.

Output is cut in several places (the execution's memory bound in kernels/execution/outputs.py,
the execute reply's budget in gateway/budget.py, the agent's tool results, the transcript's cap,
audit notes); a reader (person or model) should meet one wording wherever it was cut, with how
much, of what, why, and (where the whole value is gone) its SHA-256 so a saved copy can be checked.
This module is the common base: it imports nothing from sandkernel's subpackages, so the client
library (agent/) and the server share it without one depending on the other.

Cuts keep the head and the tail around the marker: the start of output says what ran, the end
holds the result or the error, and the middle of a flood is what a reader can spare.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple


def cut_marker(
    cut: int | None, unit: str = "characters", what: str = "output", why: str | None = None, sha256: str | None = None
) -> str:
    """The one wording for output sandkernel cut, wherever it was cut.

    ``cut`` ``unit`` of ``what`` were cut (``None`` when the amount is not known where the marker
    is written); ``why`` is a short reason; ``sha256`` (hex) lets a reader check a copy of what was
    cut. The marker is on its own line, so it never glues onto a line of the output.
    """
    amount = f"{cut} {unit} of " if cut is not None else ""
    reason = f" ({why})" if why else ""
    digest = f"; sha256 {sha256}" if sha256 else ""
    return f"\n…[sandkernel: {amount}{what} cut here{reason}{digest}]…\n"


class ClipResult(NamedTuple):
    """What :func:`clip_text` returns (a tuple, so ``text, kept, cut = clip_text(...)`` works)."""

    text: str  # the clipped text, marker included
    kept: int  # bytes (UTF-8) of the original kept, marker excluded
    cut: int  # bytes of the original cut

    @property
    def truncated(self) -> bool:
        return self.cut > 0


def clip_text(text: str, keep_bytes: int, what: str = "output", why: str | None = None) -> ClipResult:
    """Keep at most ``keep_bytes`` UTF-8 bytes of ``text``: head and tail halves around :func:`cut_marker`.

    Cuts fall on character boundaries (a split multi-byte character is dropped, never mangled), so
    ``kept`` may be a few bytes under ``keep_bytes``. The marker itself is not counted in ``kept``;
    callers that budget a whole reply count ``len(result.text.encode())`` if the marker must fit too.
    Text within the limit comes back unchanged.
    """
    keep_bytes = max(0, keep_bytes)
    raw = text.encode()
    if len(raw) <= keep_bytes:
        return ClipResult(text, len(raw), 0)
    half = keep_bytes // 2
    head = raw[:half].decode(errors="ignore")
    tail = raw[len(raw) - half :].decode(errors="ignore") if half else ""
    kept = len(head.encode()) + len(tail.encode())
    cut = len(raw) - kept
    return ClipResult(head + cut_marker(cut, "bytes", what, why) + tail, kept, cut)


def clip_chars(text: str, keep_chars: int, what: str = "output", why: str | None = None) -> str:
    """Keep at most ``keep_chars`` characters of ``text`` (head and tail) around a marker that names
    the SHA-256 of the whole text. For text kept for the record (a cell's source in a capped
    transcript, code quoted in an audit note), where a reader may want to check a copy."""
    if len(text) <= keep_chars:
        return text
    half = max(0, keep_chars) // 2
    digest = hashlib.sha256(text.encode(errors="replace")).hexdigest()
    tail = text[len(text) - half :] if half else ""
    return text[:half] + cut_marker(len(text) - 2 * half, "characters", what, why, digest) + tail
