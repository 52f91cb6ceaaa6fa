"""Compare two transcripts cell by cell, with volatile parts normalised.

Used by ``sandkernel diff A B`` and by replay (original vs replayed). Text outputs are
compared after normalisation rules (regex → replacement) that blank what legitimately changes
between runs: memory addresses, timestamps, durations, temp paths, ANSI colour codes. Images
are compared by the SHA-256 of their data; a cell whose only difference is an image is
reported as such. Verdicts: ``same``, ``changed``, ``new error``, ``error gone``, ``missing``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

import nbformat

DEFAULT_RULES: list[tuple[str, str]] = [
    (r"\x1b\[[0-9;]*m", ""),  # ANSI colours in tracebacks
    (r"0x[0-9a-fA-F]{6,16}", "0x<ADDR>"),
    (r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?", "<DATETIME>"),
    (r"\b\d+(\.\d+)?\s?(ns|µs|us|ms|s|sec|seconds)\b", "<DURATION>"),
    (r"/tmp/[\w.\-/]+", "/tmp/<PATH>"),
    (r"Cell In\[\d+\]", "Cell In[<N>]"),
]
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")


@dataclasses.dataclass(frozen=True)
class CellVerdict:
    index: int  # position among code cells, from 1
    verdict: str
    diff: str = ""
    note: str = ""


def load_rules(path: str | Path | None) -> list[tuple[str, str]]:
    """DEFAULT_RULES plus a JSON file of ``[[regex, replacement], ...]``."""
    rules = list(DEFAULT_RULES)
    if path:
        extra = json.loads(Path(path).read_text())
        if not isinstance(extra, list) or not all(isinstance(r, list) and len(r) == 2 for r in extra):
            raise ValueError('rules file must be a JSON list of ["regex", "replacement"] pairs')
        rules += [(str(a), str(b)) for a, b in extra]
    return rules


def normalise(text: str, rules: Iterable[tuple[str, str]]) -> str:
    for pattern, replacement in rules:
        text = re.sub(pattern, replacement, text)
    return text


def _text_of(outputs: list[dict], rules: list[tuple[str, str]]) -> str:
    lines = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            lines.append(f"[{out.get('name')}] " + "".join(out.get("text", "")))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            text = data.get("text/plain")
            if text is not None and not any(m in data for m in IMAGE_TYPES):
                lines.append("[result] " + "".join(text))
        elif kind == "error":
            lines.append(f"[error] {out.get('ename')}: {out.get('evalue')}")
    return normalise("\n".join(lines), rules)


def _images_of(outputs: list[dict]) -> list[str]:
    hashes = []
    for out in outputs:
        for mime in IMAGE_TYPES:
            value = out.get("data", {}).get(mime)
            if value is not None:
                raw = "".join(value) if isinstance(value, list) else str(value)
                hashes.append(f"{mime}:{hashlib.sha256(raw.encode()).hexdigest()[:16]}")
    return hashes


def _has_error(outputs: list[dict]) -> bool:
    return any(o.get("output_type") == "error" for o in outputs)


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code"]


def compare_notebooks(
    a: nbformat.NotebookNode, b: nbformat.NotebookNode, rules: list[tuple[str, str]] | None = None
) -> list[CellVerdict]:
    """Verdict for each code cell of ``a`` against the cell at the same position of ``b``."""
    rules = rules if rules is not None else DEFAULT_RULES
    cells_a, cells_b = code_cells(a), code_cells(b)
    verdicts = []
    for i, cell in enumerate(cells_a, start=1):
        if i > len(cells_b):
            verdicts.append(CellVerdict(i, "missing", note="no such cell in the other notebook"))
            continue
        other = cells_b[i - 1]
        text_a, text_b = _text_of(cell.outputs, rules), _text_of(other.outputs, rules)
        err_a, err_b = _has_error(cell.outputs), _has_error(other.outputs)
        images_same = _images_of(cell.outputs) == _images_of(other.outputs)
        if text_a == text_b and images_same:
            verdicts.append(CellVerdict(i, "same"))
            continue
        diff = "".join(
            difflib.unified_diff(
                (text_a + "\n").splitlines(keepends=True),
                (text_b + "\n").splitlines(keepends=True),
                fromfile=f"cell {i} (first)",
                tofile=f"cell {i} (second)",
            )
        )
        if err_b and not err_a:
            verdict = "new error"
        elif err_a and not err_b:
            verdict = "error gone"
        else:
            verdict = "changed"
        note = "only images differ" if text_a == text_b else ""
        verdicts.append(CellVerdict(i, verdict, diff, note))
    return verdicts


def format_report(verdicts: list[CellVerdict]) -> str:
    lines = []
    for v in verdicts:
        lines.append(f"cell {v.index}: {v.verdict}" + (f" ({v.note})" if v.note else ""))
        if v.diff:
            lines.append(v.diff.rstrip("\n"))
    same = sum(v.verdict == "same" for v in verdicts)
    lines.append(f"{same} of {len(verdicts)} code cells the same")
    return "\n".join(lines)
