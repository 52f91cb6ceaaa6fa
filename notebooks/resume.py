"""Rebuild a session's state in a fresh sandbox from its transcript: the **replay** resume.

Why replay: a memory checkpoint is possible here only for a savable gVisor sandbox (see
docs/snapshots.md; :func:`carry_on` is that path: ``restored_by: "checkpoint"``); Debian's CRIU
does not run on current kernels, so any other paused, forked or rewound session gets its memory
back by re-running the code cells that built it, through the one execute path, and every cell is judged
against what the transcript recorded (the same verdicts as ``sandkernel replay``). The result
always says ``restored_by: "replay"`` with those verdicts: a resume that was not exact is never
passed off as one.

Which cells: only those whose effects are still in the kernel's memory, i.e. after the last loss
of its state (a restart, a death, an OOM: :func:`memory_starts_at`); refused cells never ran and
are not run. Files: with a saved archive (a pause, a fork, a per-cell checkpoint), /workspace and
/tmp are put back before the cells run (so the cells find their inputs) and again after if the
cells changed any file (so the files end exactly as they were saved, whatever the cells rewrote;
a fingerprint of names, sizes and mtimes taken in the sandbox tells); without one (a rewind to a cell
no checkpoint follows) the cells run on a fresh workspace with the recorded uploads put back
before the cells that followed them, and the files are whatever the cells make (``files:
"replay"``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import nbformat

from sandkernel.errors import ConfigError, ReplayRefusedError
from sandkernel.kernels.execution.outputs import ExecutionStatus, TimeoutStep
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.snapshots.archive import ArchivePart, files_fingerprint, restore_files
from sandkernel.notebooks.compare import CellVerdict, Verdict, load_rules
from sandkernel.notebooks.replay import DEFAULT_CELL_TIMEOUT, _recorded, _run_cells, _uploads_of
from sandkernel.notebooks.side_effects import side_effects_off_the_loop

log = logging.getLogger(__name__)

REPLAY = "replay"
CHECKPOINT = "checkpoint"  # the kernel's memory came back from a gVisor checkpoint: nothing re-ran
# What a cell's recorded status or rung means for the memory: the cell's kernel ended under it
# (it died, or a restart a client asked for ended it).
DIED = frozenset({ExecutionStatus.KERNEL_DIED.value, ExecutionStatus.OOM.value, ExecutionStatus.RESTARTED.value})
REPLACED = frozenset({TimeoutStep.RESTART.value, TimeoutStep.KILL.value})


@dataclasses.dataclass(frozen=True)
class Restored:
    """How a session's state came back: the mechanism, each code cell's verdict, where its files
    came from (``snapshot``, ``checkpoint``, ``replay``) and how long it took."""

    restored_by: str
    verdicts: list[CellVerdict]
    files: str
    seconds: float
    notes: list[str]
    complete: bool = True  # every cell that built the memory was in the transcript to re-run
    unpacked: int = 0  # times the saved files were put back: 2 when the re-run cells changed any
    # What the re-run cells did beyond the sandbox when they first ran, done again by the replay
    # (notebooks/side_effects.py): code cell -> ["network", "shell", "packages"].
    side_effects: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def reproduced(self) -> bool:
        """Every cell that built the memory was re-run and agreed with the transcript."""
        return self.complete and all(v.reproduced for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "restored_by": self.restored_by,
            "reproduced": self.reproduced,
            "cells": [
                {
                    "cell": v.index,
                    "verdict": v.verdict.value,
                    "note": v.note or None,
                    "side_effects": self.side_effects.get(v.index, []) if v.verdict is not Verdict.NOT_RUN else [],
                }
                for v in self.verdicts
            ],
            "files": self.files,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
            "unpacked": self.unpacked,
        }


_Chain = tuple[int, "_Chain"] | None  # a code cell's index and the chain of those before it


def cells_in_memory(notebook: nbformat.NotebookNode, after: int | None = None, lost_since: bool = False) -> list[int]:
    """The indexes (from 1) of the code cells whose effects are in the kernel's memory right
    after code cell ``after`` (after the last: None), walking the transcript in order:

    - the session marks ``state_lost`` on the cell that lost the state (it died, or the timeout
      ladder restarted the kernel: none of it is left) and again on the next cell, which ran on
      the fresh kernel (only it is left);
    - a rewind note (``metadata.sandkernel.rewind.to``) puts memory back to what it was after that cell;
    - ``lost_since``: the state was lost after the last cell (a restart no cell has followed yet).
    """
    # Memory after each cell as a chain (cell, the chain before it): appending a cell or going
    # back to an earlier cell's state shares what came before, so the walk stays linear in the
    # transcript's length (a copied list per cell was quadratic: 6 GB for 40,000 cells).
    live: _Chain = None
    after_cell: dict[int, _Chain] = {0: None}
    index = 0
    for cell in notebook.cells:
        recorded = _recorded(cell) if isinstance(cell, dict) else {}
        if cell.get("cell_type") != "code":
            if after is not None and index >= after:
                break  # a rewind after cell ``after`` changed later memory, not that cell's
            rewind = recorded.get("rewind")
            target = rewind.get("to") if isinstance(rewind, dict) else None
            if isinstance(target, int) and not isinstance(target, bool) and target in after_cell:
                live = after_cell[target]
            continue
        index += 1
        if after is not None and index > after:
            break
        if recorded.get("status") == ExecutionStatus.REFUSED.value:
            pass  # never ran
        elif recorded.get("state_lost") and (recorded.get("status") in DIED or recorded.get("ended_by") in REPLACED):
            live = None
        elif recorded.get("state_lost"):
            live = (index, None)
        else:
            live = (index, live)
        after_cell[index] = live
    if lost_since and after is None:
        return []
    cells: list[int] = []
    while live is not None:
        cells.append(live[0])
        live = live[1]
    return cells[::-1]


async def rebuild(
    session: KernelSession,
    notebook: nbformat.NotebookNode,
    *,
    cells: list[int],
    files: tuple[Path, ArchivePart] | None = None,
    files_from: str = "snapshot",
    timeout: float = DEFAULT_CELL_TIMEOUT,
    refuse_side_effects: bool = False,
    files_in_place: bool = False,
) -> Restored:
    """Bring the fresh ``session`` to a recorded state: put back the saved ``files`` archive, if
    any, re-run the code ``cells`` (:func:`cells_in_memory`), and put the files back again.
    ``files_in_place``: the session started on the snapshot's own workspace disk (kept whole by
    a pause whose memory could not be saved): nothing to put back, and no way to put the files
    back after the cells; the notes say so if the cells changed them.
    Raises SnapshotRejectedError for an altered archive (before any cell runs),
    ReplayRefusedError when ``refuse_side_effects`` and a cell to re-run reached beyond the
    sandbox (before anything is done), and SandkernelError when the sandbox fails; what the
    cells do is in the verdicts, what they did beyond the sandbox in ``side_effects``."""
    started = time.monotonic()
    notes: list[str] = []
    side_effects = await side_effects_off_the_loop(notebook, cells)
    if refuse_side_effects and side_effects:
        said = "; ".join(f"cell {index}: {', '.join(effects)}" for index, effects in sorted(side_effects.items()))
        raise ReplayRefusedError(
            f"the state can only come back by re-running cells that reached beyond the sandbox ({said}), and this "
            "gateway refuses such replays (--replay-side-effects refuse); nothing was re-run"
        )
    complete = _all_recorded(notebook, cells, notes)
    fingerprint, unpacked = None, 0
    if files is not None:
        await restore_files(session.container, *files)
        fingerprint, unpacked = await files_fingerprint(session.container), 1
        uploads = []
    elif files_in_place:
        fingerprint, uploads = await files_fingerprint(session.container), []
        notes.append("/tmp was not kept (the workspace disk was, whole)")
    else:
        files_from = REPLAY
        try:
            uploads = _uploads_of(notebook, [], notes)
        except ConfigError as error:  # a large upload the transcript only names: the cells may miss it
            notes.append(f"an uploaded file could not be put back: {error}")
            uploads = []
    rules = load_rules(None)
    last = max(cells, default=0)
    _, verdicts = await _run_cells(session, notebook, uploads, last, timeout, rules, notes, only=set(cells))
    if files is not None and (fingerprint is None or await files_fingerprint(session.container) != fingerprint):
        await restore_files(session.container, *files)  # the cells changed files: put them back as saved
        unpacked += 1
    elif files_in_place and await files_fingerprint(session.container) != fingerprint:
        notes.append("the re-run cells changed files of the kept workspace: they are as the cells left them")
    if session.meter is not None:  # the rebuild is nobody's cell
        session.meter.forget_files()
    restored = Restored(
        REPLAY, verdicts, files_from, time.monotonic() - started, notes, complete, unpacked, side_effects
    )
    log.info(
        "session state rebuilt by replay",
        extra={
            "session": session.id,
            "cells": sum(1 for v in verdicts if v.verdict is not Verdict.NOT_RUN),
            "files": files_from,
        },
    )
    return restored


async def carry_on(session: KernelSession, files: tuple[Path, ArchivePart] | None, files_from: str) -> Restored:
    """The state of a ``session`` started from a memory checkpoint: its kernel already holds
    the memory (no cell runs); the saved files archive is put back, /workspace being a fresh
    disk. ``restored_by: "checkpoint"``, with no cell verdicts; ``files_from`` says which
    snapshot the files came from (``snapshot``: a pause or fork; ``checkpoint``: a cell's)."""
    started = time.monotonic()
    if files is not None:
        await restore_files(session.container, *files)
    if session.meter is not None:  # putting the files back is nobody's cell
        session.meter.forget_files()
    unpacked = 0 if files is None else 1
    restored = Restored(CHECKPOINT, [], files_from, time.monotonic() - started, [], True, unpacked)
    log.info("session state restored from a memory checkpoint", extra={"session": session.id})
    return restored


def _all_recorded(notebook: nbformat.NotebookNode, cells: list[int], notes: list[str]) -> bool:
    """Whether the transcript holds every cell to re-run; says what is missing otherwise (a
    transcript past its byte cap stops recording cells; a transcript file that was lost)."""
    recorded = sum(1 for cell in notebook.cells if cell.get("cell_type") == "code")
    missing = [index for index in cells if index > recorded]
    cap = notebook.metadata.get("sandkernel", {}).get("transcript_cap")
    dropped = cap.get("cells_not_recorded", 0) if isinstance(cap, dict) else 0
    if missing:
        notes.append(f"{len(missing)} cell(s) that built the memory are not in the transcript: their effects are lost")
    if dropped:
        notes.append(f"{dropped} cell(s) ran past the transcript's size cap and were not recorded: they are not re-run")
    return not missing and not dropped
