"""Replay a transcript in a fresh sandbox with nbclient and compare it with the original.

nbclient runs the code cells with our kernel manager (no kernelspec install needed), errors
allowed so every cell runs as it did in the session; the replayed notebook is written beside
the original as ``NAME.replay.ipynb``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import logging
from pathlib import Path

import nbformat
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient

from sandkernel.errors import ConfigError
from sandkernel.kernels.sandbox.kernelspec import SandkernelSpecManager
from sandkernel.kernels.sandbox.workspace_files import WorkspaceFiles
from sandkernel.notebooks.compare import CellVerdict, compare_notebooks, load_rules
from sandkernel.notebooks.transcript import write_notebook_atomic

log = logging.getLogger(__name__)


def replay_notebook(
    path: Path,
    until: int | None = None,
    kernel_name: str = "sandkernel-python",
    rules_file: str | None = None,
    timeout: float = 600,
    files: list[Path] | None = None,
) -> tuple[Path, list[CellVerdict]]:
    """Execute the first ``until`` code cells (all by default); return the replay's path and verdicts.

    Files the session uploaded are put back in the fresh workspace before the cell they preceded:
    from the transcript when embedded, else from ``files`` (matched by workspace path or name)."""
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
    inputs = _inputs_of(original, files or [])
    asyncio.run(_execute(replay, kernel_name, timeout, inputs))
    target = path.with_name(path.name.removesuffix(".ipynb") + ".replay.ipynb")
    write_notebook_atomic(replay, target)
    if until is not None:
        original = copy.deepcopy(original)
        codes = [c for c in original.cells if c.cell_type == "code"][:until]
        original.cells = codes
    return target, compare_notebooks(original, replay, load_rules(rules_file))


def _inputs_of(notebook: nbformat.NotebookNode, files: list[Path]) -> list[tuple[int, str, bytes]]:
    """(before_cell, workspace path, content) for each recorded upload; refuses what it cannot supply."""
    supplied = {}
    for local in files:
        supplied[local.name] = local
    found = []
    for entry in notebook.metadata.get("sandkernel", {}).get("inputs", []):
        local = supplied.get(entry["path"]) or supplied.get(Path(entry["path"]).name)
        if local is not None:
            data = local.read_bytes()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                log.warning("%s differs from the file the session used (%s)", local, entry["path"])
        elif "base64" in entry:
            data = base64.b64decode(entry["base64"])
        else:
            raise ConfigError(
                f"this notebook needs the file {entry['path']} ({entry['size']} bytes, sha256 "
                f"{entry['sha256'][:12]}…), too large to be embedded: pass it with --file"
            )
        found.append((int(entry.get("before_cell", 0)), entry["path"], data))
    return found


async def _execute(
    notebook: nbformat.NotebookNode, kernel_name: str, timeout: float, inputs: list[tuple[int, str, bytes]]
) -> None:
    """nbclient's execute, cell by cell, with the session's uploads written in between."""
    km = AsyncKernelManager(kernel_name=kernel_name, kernel_spec_manager=SandkernelSpecManager())
    client = NotebookClient(notebook, km=km, timeout=timeout, startup_timeout=120, allow_errors=True)
    client.reset_execution_trackers()
    try:
        async with client.async_setup_kernel():
            info = await client.async_wait_for_reply(client.kc.kernel_info())
            notebook.metadata["language_info"] = info["content"]["language_info"]
            code_cells = 0
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type == "code":
                    due = [(p, data) for before, p, data in inputs if before == code_cells]
                    for workspace_path, data in due:
                        await WorkspaceFiles(km.provisioner.container).write(workspace_path, data)
                    code_cells += 1
                await client.async_execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
    finally:  # nbclient leaves a kernel it did not create running; the container goes with it
        if km.has_kernel:
            await km.shutdown_kernel(now=True)
