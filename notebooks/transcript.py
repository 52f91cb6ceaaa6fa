"""Turn executions into notebook cells and write notebooks atomically.

The first piece of the transcript recorder: an :class:`ExecutionResult` is already in
nbformat output shape, so a cell is the code plus those outputs plus timing metadata.
Writes go through :mod:`sandkernel.atomic` (temp file in the same directory, fsync, rename,
fsync the directory), so a reader (or a crash) never sees a half-written notebook.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import nbformat
from nbformat.v4 import new_markdown_cell, new_notebook

from sandkernel.atomic import write_atomic
from sandkernel.kernels.execution.outputs import ExecutionResult


def result_to_cell(
    code: str, result: ExecutionResult, tag: str | None = None, source: str | None = None
) -> nbformat.NotebookNode:
    """A code cell for one execution: its outputs in order, and what happened in metadata.

    ``tag`` is the caller's label (e.g. the agent's tool-use id); ``source`` the door the code
    came through (session_api, websocket, agent, cli)."""
    # Built as plain dicts: outputs are already nbformat-shaped (output_from_msg), and nbformat's
    # constructors would validate each one against the schema (1 ms a cell). The notebook is
    # validated as a whole in the tests and by readers.
    outputs = [dict(output) for output in result.outputs]
    info = {
        "status": result.status.value,
        "started_at": result.started_at,
        "duration": result.duration,
        "ended_by": result.ended_by.value if result.ended_by else None,
        "state_lost": result.state_lost,
    }
    if result.chars_cut or result.outputs_dropped or result.bytes_omitted:
        info["truncated"] = {
            "chars_cut": result.chars_cut,
            "outputs_dropped": result.outputs_dropped,
            "bytes_omitted": result.bytes_omitted,
        }
    if result.accounting is not None:  # JupyterLab shows it in the cell's metadata
        info["accounting"] = result.accounting
    if result.policy:
        info["policy"] = list(result.policy)
    if result.refusal is not None:  # nothing ran: replay skips the cell
        info["refusal"] = result.refusal
    if tag:
        info["tag"] = tag
    if source:
        info["source"] = source
    return nbformat.from_dict(
        {
            "cell_type": "code",
            "id": uuid.uuid4().hex[:16],
            "source": code,
            "outputs": outputs,
            "execution_count": result.execution_count,
            "metadata": {"sandkernel": info},
        }
    )


def markdown_cell(text: str) -> nbformat.NotebookNode:
    return new_markdown_cell(text)


def build_notebook(cells: list[nbformat.NotebookNode], metadata: dict) -> nbformat.NotebookNode:
    notebook = new_notebook(cells=cells)
    notebook.metadata.update(
        {
            "kernelspec": {
                "name": "sandkernel-python",
                "display_name": "Python 3 (sandkernel, Docker)",
                "language": "python",
            },
            "language_info": {"name": "python"},
            "sandkernel": metadata,
        }
    )
    return notebook


def write_notebook_atomic(notebook: nbformat.NotebookNode, path: Path) -> None:
    """Validate, then replace ``path`` atomically and durably (:func:`sandkernel.atomic.write_atomic`).

    Raises ``nbformat.ValidationError`` before touching the file if the notebook is invalid."""
    nbformat.validate(notebook)
    text = nbformat.writes(notebook)
    write_atomic(path, text if text.endswith("\n") else text + "\n")
