"""What a recorded cell did beyond its sandbox's memory and files: what a replay would do again.

A replay resume re-runs the cells that built a kernel's memory (notebooks/resume.py). Most only
compute; some reached out, and replaying them does it a second time: the same HTTP request sent
again, the same shell command run again. Before a replay, each cell to re-run is read for:

- ``network``: its accounting (kept in the transcript, kernels/execution/accounting.py) counted
  requests through the session's egress proxy, allowed, refused or failed (each was sent);
- ``shell``: its source runs a program or a shell command (``!cmd``, ``%%bash``, ``%system``,
  ``os.system``, ``subprocess``...), found by the code policy's own reading of the cell
  (kernels/policy/python_review.py: a static reading, so code built at run time escapes it);
- ``packages``: it installed or removed packages (``%pip install``...), which reaches the
  package index or the wheelhouse.

Writes outside /workspace and /tmp are not looked for: the sandbox's root file system is
read-only, so no cell can have made one. The report is advisory for ``shell`` (static) and exact
for ``network`` (the proxy saw every request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import nbformat

from sandkernel.kernels.policy import rules
from sandkernel.kernels.policy.paths import WORKSPACE
from sandkernel.kernels.policy.python_review import review_tree, transform
from sandkernel.notebooks.compare import code_cells

NETWORK, SHELL, PACKAGES = "network", "shell", "packages"
SHELL_RULES = frozenset({rules.SHELL, rules.OS_SYSTEM, rules.SUBPROCESS})
WRITABLE = (WORKSPACE, "/tmp")


def side_effects_of(notebook: nbformat.NotebookNode, cells: Iterable[int]) -> dict[int, list[str]]:
    """For each code cell of ``cells`` (counted from 1) that reached beyond the sandbox when it
    first ran, what it did (:data:`NETWORK`, :data:`SHELL`, :data:`PACKAGES`); others are left out."""
    recorded = code_cells(notebook)
    found = {}
    for index in cells:
        if 1 <= index <= len(recorded):
            effects = cell_side_effects(recorded[index - 1])
            if effects:
                found[index] = effects
    return found


async def side_effects_off_the_loop(notebook: nbformat.NotebookNode, cells: Iterable[int]) -> dict[int, list[str]]:
    """:func:`side_effects_of` in a worker thread. Why: each cell is parsed through IPython's
    transformer (about 0.2 ms, and 0.1 s to import it the first time), so reading a long
    session's cells before its replay held the gateway's event loop, every tenant's requests
    with it, for seconds (issue 30, item 3)."""
    return await asyncio.to_thread(side_effects_of, notebook, list(cells))


def cell_side_effects(cell: Any) -> list[str]:
    effects = []
    info = (cell.get("metadata") or {}).get("sandkernel") or {}
    egress = (info.get("accounting") or {}).get("egress") if isinstance(info, dict) else None
    if isinstance(egress, dict) and any(isinstance(n, int) and n > 0 for n in egress.values()):
        effects.append(NETWORK)
    source = cell.get("source") or ""
    _, tree = transform(source if isinstance(source, str) else "".join(source))
    found = {finding.rule for finding in review_tree(tree, WRITABLE)} if tree is not None else set()
    if found & SHELL_RULES:
        effects.append(SHELL)
    if rules.PACKAGE_INSTALL in found:
        effects.append(PACKAGES)
    return effects
