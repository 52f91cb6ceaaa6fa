"""Read notebooks sandkernel did not write, and write notebooks that always validate.

Replay accepts any notebook a person might try: an nbformat 3 file (converted), 4.0-4.4 files
whose cells have no ids, a ``kernelspec`` with no ``name`` (common in hand-made or converted
notebooks), no ``language_info``, cell metadata or outputs the schema rejects. Reading never
raises anything but :class:`ConfigError` (with what is wrong), and each repair is reported as a
sentence instead of being made silently. Writing goes through :func:`valid_cell` and
:func:`valid_metadata`, which validate each piece alone and drop (and report) only the piece the
schema rejects, so the notebook as a whole validates and no NotebookValidationError escapes.

A notebook for another language (R, Julia...) is refused before any sandbox starts: running
its cells as Python would only produce a page of SyntaxErrors.
"""

from __future__ import annotations

import copy
import re
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import nbformat
from nbformat import validator

from sandkernel.errors import ConfigError

# The nbformat minor version the replay is written in: cell ids are required from 4.5 on.
NBFORMAT_MINOR = 5
CELL_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")
# Notebook metadata the replay writes itself, never copies: the kernel it ran on, and the
# original run's widget state (its model ids name widgets that do not exist in the replay).
OWN_METADATA = frozenset(
    {"kernelspec", "language_info", "sandkernel", "widgets", "orig_nbformat", "orig_nbformat_minor"}
)
# Cell metadata describing the original run (timings of other tools), not the replayed one.
RUN_METADATA = frozenset({"sandkernel", "execution", "ExecuteTime", "papermill"})


def load_notebook(path: Path) -> tuple[nbformat.NotebookNode, list[str]]:
    """The notebook at ``path`` as nbformat 4, and sentences on what was odd about it.

    Raises :class:`ConfigError` when it is missing, not a notebook, or not a Python notebook."""
    if not path.is_file():
        raise ConfigError(f"no notebook at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from err
    try:
        # nbformat.read without its validation, which logs a schema error as an ERROR line:
        # an invalid notebook is expected here, and is reported as a note instead.
        notebook = nbformat.convert(nbformat.reader.reads(text), 4)
    except (ValueError, jsonschema.ValidationError, AttributeError, KeyError, TypeError) as err:
        # nbformat's reader and converters raise these for JSON that is not a notebook.
        raise ConfigError(f"{path} is not a notebook nbformat can read: {str(err).splitlines()[0][:200]}") from err
    if not isinstance(notebook.get("cells"), list) or not isinstance(notebook.get("metadata"), dict):
        raise ConfigError(f"{path} is not a notebook: it has no list of cells")
    notes = []
    problem = next((str(e.message)[:200] for e in validator.iter_validate(notebook)), None)
    if problem is not None:
        notes.append(f"the notebook does not validate as it is ({problem}); replayed anyway, the replay is valid")
    original = notebook.metadata.get("orig_nbformat")
    if original is not None:
        minor = notebook.metadata.get("orig_nbformat_minor", 0)
        notes.append(f"converted from nbformat {original}.{minor} to 4.{NBFORMAT_MINOR}")
    notes += _check_language(path, notebook.metadata)
    return notebook, notes


def _check_language(path: Path, metadata: dict[str, Any]) -> list[str]:
    """Refuse a notebook that says it is not Python; describe an odd kernelspec."""
    kernelspec = metadata.get("kernelspec") if isinstance(metadata.get("kernelspec"), dict) else {}
    info = metadata.get("language_info") if isinstance(metadata.get("language_info"), dict) else {}
    language = kernelspec.get("language") or info.get("name")
    kernel = kernelspec.get("name") or kernelspec.get("display_name")
    named = language.strip().lower() if isinstance(language, str) else ""
    if named and not named.startswith(("python", "ipython")):
        raise ConfigError(
            f"{path.name} is a {language} notebook (kernel {kernel or 'unnamed'}); "
            "sandkernel runs Python only, so it cannot replay it"
        )
    notes = []
    if "kernelspec" in metadata and not kernelspec.get("name"):
        shown = f" (display name {kernelspec['display_name']!r})" if kernelspec.get("display_name") else ""
        notes.append(f"metadata.kernelspec has no name{shown}; the replay records the sandkernel kernel it ran on")
    if not language:
        notes.append(
            "the notebook does not say its language (no kernelspec.language, no language_info); assumed Python"
        )
    return notes


def _skeleton(cells: list[Any], metadata: dict[str, Any]) -> dict[str, Any]:
    return {"nbformat": 4, "nbformat_minor": NBFORMAT_MINOR, "metadata": metadata, "cells": cells}


def _first_error(notebook: dict[str, Any]) -> str | None:
    """The schema's complaint about ``notebook``, or None when it is valid."""
    for error in validator.iter_validate(notebook, version=4, version_minor=NBFORMAT_MINOR):
        return str(error.message)[:200]
    return None


def cell_id(cell: Any, taken: set[str]) -> tuple[str, bool]:
    """The cell's own id when it is valid and not taken, else a new one; and whether it is new."""
    own = cell.get("id") if isinstance(cell, dict) else None
    if isinstance(own, str) and CELL_ID.match(own) and own not in taken:
        taken.add(own)
        return own, False
    new = uuid.uuid4().hex[:16]
    taken.add(new)
    return new, True


def copied_cell(cell: dict[str, Any], new_id: str) -> dict[str, Any]:
    """A markdown or raw cell as the replay keeps it (any other cell type becomes raw, as text)."""
    kind = cell.get("cell_type") if cell.get("cell_type") in ("markdown", "raw") else "raw"
    kept: dict[str, Any] = {
        "cell_type": kind,
        "id": new_id,
        "metadata": copy.deepcopy(cell.get("metadata")) if isinstance(cell.get("metadata"), dict) else {},
        "source": source_of(cell),
    }
    if isinstance(cell.get("attachments"), dict):
        kept["attachments"] = copy.deepcopy(cell["attachments"])
    return kept


def source_of(cell: dict[str, Any]) -> str:
    """A cell's source as one string (nbformat stores lists of lines, too)."""
    source = cell.get("source", "")
    if isinstance(source, list):
        return "".join(str(line) for line in source)
    return source if isinstance(source, str) else ""


def cell_metadata(cell: dict[str, Any]) -> dict[str, Any]:
    """The original cell's own metadata (tags, collapsed...) without what described its old run."""
    metadata = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
    return {k: copy.deepcopy(v) for k, v in metadata.items() if k not in RUN_METADATA}


def valid_cell(cell: dict[str, Any], label: str, notes: list[str]) -> dict[str, Any]:
    """``cell`` if the schema accepts it; else with what it rejects dropped and a note saying so.

    Dropped in turn until the cell validates: the metadata copied from the original (sandkernel's
    own is kept), the attachments, then each output the schema rejects on its own (e.g. from a
    kernel that sent malformed data), replaced by a stderr line naming it. Raises ConfigError
    only if even that cell does not validate (a bug of ours, reported rather than written)."""
    error = _first_error(_skeleton([cell], {}))
    if error is None:
        return cell
    metadata = cell.get("metadata", {})
    repaired = {**cell, "metadata": {"sandkernel": metadata["sandkernel"]} if "sandkernel" in metadata else {}}
    repaired.pop("attachments", None)
    dropped = [
        what
        for what, gone in (("metadata", metadata != repaired["metadata"]), ("attachments", "attachments" in cell))
        if gone
    ]
    if cell.get("cell_type") == "code":
        outputs = []
        for output in cell.get("outputs", []):
            if _first_error(_skeleton([{**repaired, "outputs": [output]}], {})) is None:
                outputs.append(output)
                continue
            kind = output.get("output_type") if isinstance(output, dict) else type(output).__name__
            dropped.append(f"an output ({kind})")
            text = f"[sandkernel: an output ({kind}) the notebook format rejects was left out]\n"
            outputs.append({"output_type": "stream", "name": "stderr", "text": text})
        repaired["outputs"] = outputs
    still = _first_error(_skeleton([repaired], {}))
    if still is not None:
        raise ConfigError(f"{label} cannot be written as a valid notebook cell: {still}")
    notes.append(f"{label}: the notebook schema rejected it ({error}); left out: {', '.join(dropped)}")
    return repaired


def valid_metadata(own: dict[str, Any], copied: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Notebook metadata the schema accepts: ``own`` (the replay's kernelspec, language_info,
    sandkernel) plus each key of ``copied`` (the original's) that validates alongside it."""
    kept = dict(own)
    for key, value in copied.items():
        if key in OWN_METADATA:
            continue
        error = _first_error(_skeleton([], {**kept, key: value}))
        if error is None:
            kept[key] = value
        else:
            notes.append(f"metadata.{key} was rejected by the notebook schema ({error}) and left out")
    error = _first_error(_skeleton([], kept))
    if error is not None:
        raise ConfigError(f"the replay's notebook metadata does not validate: {error}")
    return kept


def new_notebook(cells: list[dict[str, Any]], metadata: dict[str, Any]) -> nbformat.NotebookNode:
    """A v4.5 notebook of already-validated cells and metadata (see :func:`valid_cell`)."""
    return nbformat.from_dict(_skeleton(cells, metadata))
