"""The transcript recorder: every execution of a session becomes a cell of one .ipynb file.

The session layer calls :meth:`TranscriptRecorder.record` after each execute, whichever door
the code came through, and :meth:`note` when state is lost (restart, OOM, crash), so a reader
sees where it happened. After every cell the notebook is validated and written atomically
(temp file, fsync, rename), so a gateway killed at any moment leaves a valid notebook holding
every completed cell. Transcripts are never signed: hostile HTML or JavaScript in outputs does
not run when a reviewer opens them in Jupyter.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from pathlib import Path
from typing import Any

import nbformat

from sandkernel.kernels.outputs import ExecutionResult
from sandkernel.notebooks.transcript import build_notebook, markdown_cell, result_to_cell, write_notebook_atomic


def default_notebook_dir() -> Path:
    """SANDKERNEL_NOTEBOOK_DIR, else $XDG_DATA_HOME/sandkernel/notebooks (~/.local/share/...)."""
    if os.environ.get("SANDKERNEL_NOTEBOOK_DIR"):
        return Path(os.environ["SANDKERNEL_NOTEBOOK_DIR"])
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "sandkernel" / "notebooks"


def notebook_path_for(session_id: str, directory: Path | None = None) -> Path:
    """One file per session, named so a person can find it: date, time, session id."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H-%M-%SZ")
    return (directory or default_notebook_dir()) / f"{stamp}_{session_id}.ipynb"


class TranscriptRecorder:
    """Appends cells to one session's notebook and keeps the file valid after each."""

    def __init__(self, path: Path, metadata: dict[str, Any]) -> None:
        self.path = path
        self.notebook = build_notebook([], {"created": dt.datetime.now(dt.timezone.utc).isoformat(), **metadata})
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Write the empty notebook, so the file exists from the session's first moment."""
        await self._flush()

    async def record(
        self, code: str, result: ExecutionResult, tag: str | None = None, source: str | None = None
    ) -> None:
        """Append one execution (preceded by a note if state was lost before it)."""
        async with self._lock:
            self.notebook.cells.append(result_to_cell(code, result, tag=tag, source=source))
            await self._flush()

    async def note(self, text: str) -> None:
        """A markdown note from sandkernel itself (kernel restarts, deaths)."""
        await self.add_markdown(f"> **sandkernel:** {text}", role="event")

    async def add_markdown(self, text: str, role: str = "agent") -> None:
        """A markdown cell (the agent's reasoning, or a note), recorded in order."""
        async with self._lock:
            cell = markdown_cell(text)
            cell.metadata["sandkernel"] = {"role": role, "at": dt.datetime.now(dt.timezone.utc).isoformat()}
            self.notebook.cells.append(cell)
            await self._flush()

    def update_metadata(self, **values: Any) -> None:
        self.notebook.metadata["sandkernel"].update(values)

    async def _flush(self) -> None:
        snapshot = nbformat.from_dict(self.notebook)  # copy: later appends never race the writer
        await asyncio.to_thread(write_notebook_atomic, snapshot, self.path)

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)
