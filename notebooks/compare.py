"""Compare two transcripts cell by cell, with volatile parts normalised.

Used by ``sandkernel diff A B`` and by replay (original vs replayed). Text outputs are
compared after normalisation rules (regex → replacement) that blank what legitimately changes
between runs: memory addresses, timestamps, durations, temp paths, ANSI colour codes. Images
(:data:`sandkernel.mime.IMAGE_MIME_TYPES`) are compared by the SHA-256 of their data; a cell
whose only difference is an image is reported as such.

Notebooks come from anywhere (public notebooks, other tools), so every output is read
defensively: an output that is not a mapping, or of a type nbformat does not know, is left out
of the comparison and named in the verdict's note, never raised.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import nbformat

from sandkernel.mime import IMAGE_MIME_TYPES, is_image
from sandkernel.notebooks.exit_codes import (  # noqa: F401 (re-exported for callers)
    EXIT_BAD_INPUT,
    EXIT_CODES,
    EXIT_DIFFERENT,
    EXIT_SAME,
    EXIT_SANDBOX_FAILED,
)

DEFAULT_RULES: list[tuple[str, str]] = [
    (r"\x1b\[[0-9;]*m", ""),  # ANSI colours in tracebacks
    (r"0x[0-9a-fA-F]{6,16}", "0x<ADDR>"),
    (r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?", "<DATETIME>"),
    (r"\b\d+(\.\d+)?\s?(ns|µs|us|ms|s|sec|seconds)\b", "<DURATION>"),
    (r"/tmp/[\w.\-/]+", "/tmp/<PATH>"),
    (r"Cell In\[\d+\]", "Cell In[<N>]"),
]
KNOWN_OUTPUT_TYPES = frozenset({"stream", "execute_result", "display_data", "error"})


class Verdict(str, enum.Enum):
    """What became of one code cell. ``missing`` only comes from ``diff`` (the second notebook
    has fewer code cells); ``kernel died``, ``timed out`` and ``not run`` only from replay."""

    SAME = "same"
    CHANGED = "changed"
    NEW_ERROR = "new error"
    ERROR_GONE = "error gone"
    KERNEL_DIED = "kernel died"
    TIMED_OUT = "timed out"
    NOT_RUN = "not run"
    MISSING = "missing"


@dataclasses.dataclass(frozen=True)
class CellVerdict:
    """One code cell's verdict. ``index`` counts code cells from 1.

    ``as_recorded`` is True when a replay's death or timeout is what the original transcript
    recorded for that cell too (sandkernel writes each cell's status in its metadata): the
    replay reproduced it, so it is not a difference.
    """

    index: int
    verdict: Verdict
    diff: str = ""
    note: str = ""
    as_recorded: bool = False

    @property
    def reproduced(self) -> bool:
        """Whether this cell agrees with the original (what the exit code counts)."""
        return self.verdict in (Verdict.SAME, Verdict.NOT_RUN) or self.as_recorded


def load_rules(path: str | Path | None) -> list[tuple[str, str]]:
    """DEFAULT_RULES plus a JSON file of ``[[regex, replacement], ...]``. Raises ValueError
    (a bad file or pattern) or OSError (an unreadable one)."""
    rules = list(DEFAULT_RULES)
    if path:
        extra = json.loads(Path(path).read_text())
        if not isinstance(extra, list) or not all(isinstance(r, list) and len(r) == 2 for r in extra):
            raise ValueError('rules file must be a JSON list of ["regex", "replacement"] pairs')
        for pattern, _ in extra:
            try:
                re.compile(str(pattern))
            except re.error as err:
                raise ValueError(f"rules file: {pattern!r} is not a regular expression ({err})") from None
        rules += [(str(a), str(b)) for a, b in extra]
    return rules


def normalise(text: str, rules: Iterable[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text)
    return text


def _joined(value: Any) -> str:
    """nbformat multiline text (a string or a list of strings) as one string."""
    if isinstance(value, list):
        return "".join(str(part) for part in value)
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _outputs(outputs: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The outputs a comparison can read, and a description of each one it had to leave out."""
    if not isinstance(outputs, list):
        return [], ([f"outputs of type {type(outputs).__name__}, not a list"] if outputs is not None else [])
    readable, skipped = [], []
    for output in outputs:
        kind = output.get("output_type") if isinstance(output, dict) else None
        if kind in KNOWN_OUTPUT_TYPES:
            readable.append(output)
        else:
            skipped.append(f"an output of unknown type {kind!r}" if isinstance(output, dict) else "a malformed output")
    return readable, skipped


def _text_of(outputs: list[dict[str, Any]], rules: list[tuple[str, str]]) -> str:
    lines = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            lines.append(f"[{out.get('name')}] " + _joined(out.get("text", "")))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data") if isinstance(out.get("data"), dict) else {}
            text = data.get("text/plain")
            if text is not None and not any(is_image(m) for m in data):
                lines.append("[result] " + _joined(text))
        elif kind == "error":
            lines.append(f"[error] {out.get('ename')}: {out.get('evalue')}")
    return normalise("\n".join(lines), rules)


def _images_of(outputs: list[dict[str, Any]]) -> list[str]:
    hashes = []
    for out in outputs:
        data = out.get("data") if isinstance(out.get("data"), dict) else {}
        for mime in IMAGE_MIME_TYPES:
            value = data.get(mime)
            if value is not None:
                hashes.append(f"{mime}:{hashlib.sha256(_joined(value).encode()).hexdigest()[:16]}")
    return hashes


def _has_error(outputs: list[dict[str, Any]]) -> bool:
    return any(o.get("output_type") == "error" for o in outputs)


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if isinstance(c, dict) and c.get("cell_type") == "code"]


def compare_outputs(index: int, first: Any, second: Any, rules: list[tuple[str, str]] | None = None) -> CellVerdict:
    """Verdict for code cell ``index`` whose outputs were ``first`` and are now ``second``:
    same, changed, new error or error gone, with a unified diff of the normalised text."""
    rules = rules if rules is not None else DEFAULT_RULES
    outs_a, skipped_a = _outputs(first)
    outs_b, skipped_b = _outputs(second)
    text_a, text_b = _text_of(outs_a, rules), _text_of(outs_b, rules)
    skipped = skipped_a + skipped_b
    skip_note = f"left out of the comparison: {', '.join(sorted(set(skipped)))}" if skipped else ""
    if text_a == text_b and _images_of(outs_a) == _images_of(outs_b):
        return CellVerdict(index, Verdict.SAME, note=skip_note)
    diff = "".join(
        difflib.unified_diff(
            (text_a + "\n").splitlines(keepends=True),
            (text_b + "\n").splitlines(keepends=True),
            fromfile=f"cell {index} (first)",
            tofile=f"cell {index} (second)",
        )
    )
    err_a, err_b = _has_error(outs_a), _has_error(outs_b)
    if err_b and not err_a:
        verdict = Verdict.NEW_ERROR
    elif err_a and not err_b:
        verdict = Verdict.ERROR_GONE
    else:
        verdict = Verdict.CHANGED
    notes = ["only images differ"] if text_a == text_b else []
    return CellVerdict(index, verdict, diff, "; ".join([*notes, *([skip_note] if skip_note else [])]))


def compare_notebooks(
    a: nbformat.NotebookNode, b: nbformat.NotebookNode, rules: list[tuple[str, str]] | None = None
) -> list[CellVerdict]:
    """Verdict for each code cell of ``a`` against the cell at the same position of ``b``."""
    cells_a, cells_b = code_cells(a), code_cells(b)
    verdicts = []
    for i, cell in enumerate(cells_a, start=1):
        if i > len(cells_b):
            verdicts.append(CellVerdict(i, Verdict.MISSING, note="no such cell in the other notebook"))
            continue
        verdicts.append(compare_outputs(i, cell.get("outputs"), cells_b[i - 1].get("outputs"), rules))
    return verdicts


def format_summary(verdicts: Sequence[CellVerdict]) -> str:
    """One line: how many code cells are the same, then the count of each other verdict in the
    order of :class:`Verdict`: ``5 of 8 code cells the same (1 kernel died, 2 not run)``."""
    counts = Counter(v.verdict for v in verdicts)
    parts = [f"{counts[kind]} {kind.value}" for kind in Verdict if counts[kind] and kind is not Verdict.SAME]
    same = counts[Verdict.SAME]
    return f"{same} of {len(verdicts)} code cells the same" + (f" ({', '.join(parts)})" if parts else "")


def format_report(verdicts: Sequence[CellVerdict]) -> str:
    """Each cell's verdict (with its note and diff), then :func:`format_summary`."""
    lines = []
    for v in verdicts:
        lines.append(f"cell {v.index}: {v.verdict.value}" + (f" ({v.note})" if v.note else ""))
        if v.diff:
            lines.append(v.diff.rstrip("\n"))
    lines.append(format_summary(verdicts))
    return "\n".join(lines)


def exit_code(verdicts: Sequence[CellVerdict]) -> int:
    """0 when every code cell agrees with the original (same, not run, or a death/timeout the
    original recorded too), else 1. Bad input (2) and a sandbox that could not run (3) are the
    caller's to report."""
    return EXIT_SAME if all(v.reproduced for v in verdicts) else EXIT_DIFFERENT
