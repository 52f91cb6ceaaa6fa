"""Replay a transcript in a fresh sandbox with nbclient and compare it with the original.

nbclient runs the code cells with our kernel manager (no kernelspec install needed), errors
allowed so every cell runs as it did in the session; the replayed notebook is written beside
the original as ``NAME.replay.ipynb``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient

from sandkernel.kernels.kernelspec import SandkernelSpecManager
from sandkernel.notebooks.compare import CellVerdict, compare_notebooks, load_rules
from sandkernel.notebooks.transcript import write_notebook_atomic


def replay_notebook(
    path: Path,
    until: int | None = None,
    kernel_name: str = "sandkernel-python",
    rules_file: str | None = None,
    timeout: float = 600,
) -> tuple[Path, list[CellVerdict]]:
    """Execute the first ``until`` code cells (all by default); return the replay's path and verdicts."""
    original = nbformat.read(path, as_version=4)
    replay = copy.deepcopy(original)
    kept, seen = [], 0
    for cell in replay.cells:
        if cell.cell_type == "code":
            seen += 1
            if until is not None and seen > until:
                continue
            cell.outputs = []
            cell.execution_count = None
        kept.append(cell)
    replay.cells = kept
    km = AsyncKernelManager(kernel_name=kernel_name, kernel_spec_manager=SandkernelSpecManager())
    NotebookClient(replay, km=km, timeout=timeout, startup_timeout=120, allow_errors=True).execute()
    target = path.with_name(path.name.removesuffix(".ipynb") + ".replay.ipynb")
    write_notebook_atomic(replay, target)
    if until is not None:
        original = copy.deepcopy(original)
        codes = [c for c in original.cells if c.cell_type == "code"][:until]
        original.cells = codes
    return target, compare_notebooks(original, replay, load_rules(rules_file))
