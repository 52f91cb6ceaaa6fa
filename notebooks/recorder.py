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
import base64
import contextlib
import datetime as dt
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import nbformat

from sandkernel.atomic import sync, write_atomic
from sandkernel.kernels.execution.outputs import ExecutionResult, output_size, replace_with_markers
from sandkernel.notebooks.transcript import build_notebook, markdown_cell, result_to_cell
from sandkernel.truncation import clip_chars

# Write pacing for large transcripts (see _write_behind).
PACE_ABOVE_SECONDS = 0.002
MAX_PACE_SECONDS = 2.0

# Uploaded files up to this size are embedded in the transcript (see record_input).
EMBED_INPUT_BYTES = 2 * 1024 * 1024

# The most one session's transcript may take, on disk and (about twice) in the gateway's memory,
# in bytes: kernel output is untrusted, and a loop that displays 60 MB blobs must not fill the
# host's disk. Large outputs are replaced by a marker with their size and SHA-256 rather than
# stored beside the notebook under a disk quota: the transcript stays one self-contained, valid
# notebook (nothing else to copy, reap or keep in step), and the hash still lets a reviewer check
# a copy the code saved in its workspace.
MAX_TRANSCRIPT_BYTES = 32 * 1024 * 1024
# Past this share of the cap, new cells keep only small outputs (markers for the rest) and their
# source is clipped to SOURCE_KEEP_CHARS, so the rest of the session is still on record.
FULL_CELLS_SHARE = 0.75
SOURCE_KEEP_CHARS = 16 * 1024
# Share of the cap kept free for the notebook's metadata (session facts, egress summary): 2 MiB
# of the default 32 MiB. Cells past the rest are counted in the metadata, not recorded.
METADATA_RESERVE_SHARE = 1 / 16


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
    """Appends cells to one session's notebook; a writer task it owns keeps the file current.

    Recording is off the execute's critical path (an append and a JSON dump of the new cell);
    the writer task then rebuilds the file from cached per-cell JSON, writes it to a temp file
    and renames it over the old one, so the file on disk is always a complete, valid notebook
    holding whole cells: a process killed at any moment leaves the previous or the new one.
    Writes coalesce under bursts; fsync follows ``SYNC_DELAY`` after the last write, for
    durability against power loss. :meth:`flushed` waits until the file holds every cell.
    """

    SYNC_DELAY = 0.2  # seconds

    def __init__(self, path: Path, metadata: dict[str, Any], max_bytes: int = MAX_TRANSCRIPT_BYTES) -> None:
        self.path = path
        self.notebook = build_notebook([], {"created": dt.datetime.now(dt.timezone.utc).isoformat(), **metadata})
        self.max_bytes = max_bytes
        self.full_cells_bytes = int(max_bytes * FULL_CELLS_SHARE)
        self._cells_json: list[str] = []
        self._cells_bytes = 0  # bytes of _cells_json
        self._inputs_bytes = 0  # bytes of uploaded files embedded in the metadata
        self._cells_not_recorded = 0
        self._version = 0  # bumped on every change
        self._written = 0  # version the file holds
        self._changed = asyncio.Event()
        self._written_cond = asyncio.Condition()
        self._writer: asyncio.Task | None = None
        self._reopened = False  # the file holds a previous process's cells (see reopen)

    @classmethod
    def reopen(
        cls, path: Path, metadata: dict[str, Any] | None = None, max_bytes: int = MAX_TRANSCRIPT_BYTES
    ) -> TranscriptRecorder:
        """The recorder of a transcript a previous gateway process wrote (a restart): its cells
        are kept and later ones appended to the same file, within the same byte cap.

        Blocking (reads the file): call from a thread. A file that is missing, not a regular
        file of ours, or not a notebook is not trusted: it is moved aside (``.unreadable-<time>``)
        and the session's record starts again at the same path, saying so in its metadata."""
        recorder = cls(path, metadata or {}, max_bytes)
        try:
            notebook = _read_own_notebook(path)
        except FileNotFoundError:
            recorder.update_metadata(transcript_restarted="the previous transcript file was missing")
            return recorder
        except (OSError, ValueError) as err:
            aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
            with contextlib.suppress(OSError):
                os.rename(path, aside)
            recorder.update_metadata(
                transcript_restarted=f"the previous file could not be read ({err}); kept as {aside.name}"
            )
            return recorder
        recorder.notebook = notebook
        recorder._reopened = True
        recorder.notebook.metadata.setdefault("sandkernel", {}).update(metadata or {})
        for cell in notebook.cells:
            text = json.dumps(cell, sort_keys=True, indent=1, ensure_ascii=False)
            recorder._cells_json.append(text)
            recorder._cells_bytes += len(text) + 2
        inputs = notebook.metadata["sandkernel"].get("inputs", [])
        recorder._inputs_bytes = sum(len(i.get("base64", "")) for i in inputs if isinstance(i, dict))
        cap = notebook.metadata["sandkernel"].get("transcript_cap") or {}
        recorder._cells_not_recorded = int(cap.get("cells_not_recorded", 0)) if isinstance(cap, dict) else 0
        return recorder

    async def start(self) -> None:
        """Create the file (empty notebook) and the writer task. A reopened transcript's file is
        already there: it is rewritten in the background, not waited for (a restarted gateway
        adopts many sessions before it listens)."""
        await asyncio.to_thread(self.path.parent.mkdir, parents=True, exist_ok=True)
        self._mark_changed()
        if not self._reopened:
            await self.flushed()

    async def record(
        self, code: str, result: ExecutionResult, tag: str | None = None, source: str | None = None
    ) -> None:
        """Append one execution (the file follows within a write)."""
        self._append(result_to_cell(code, result, tag=tag, source=source))

    async def note(self, text: str) -> None:
        """A markdown note from sandkernel itself (kernel restarts, deaths)."""
        await self.add_markdown(f"> **sandkernel:** {text}", role="event")

    async def add_markdown(self, text: str, role: str = "agent", **fields: Any) -> None:
        """A markdown cell (the agent's reasoning, or a note), recorded in order; ``fields`` go in
        its ``metadata.sandkernel`` (a rewind says where to: notebooks/resume.py reads it)."""
        cell = markdown_cell(text)
        cell.metadata["sandkernel"] = {"role": role, "at": dt.datetime.now(dt.timezone.utc).isoformat(), **fields}
        self._append(cell)

    def inherit(self, notebook: nbformat.NotebookNode, parent: str, code_cells: int) -> None:
        """Start this transcript with the cells of ``parent``'s (a fork) up to its ``code_cells``-th
        code cell, each marked ``metadata.sandkernel.inherited``, and its uploaded inputs, so the
        fork's notebook reads, replays and resumes as a whole."""
        seen = 0
        for cell in notebook.cells:
            if cell.get("cell_type") == "code":
                seen += 1
                if seen > code_cells:
                    break
            copied = nbformat.from_dict(json.loads(json.dumps(cell)))
            copied.setdefault("metadata", {}).setdefault("sandkernel", {})["inherited"] = {"from": parent}
            self._append(copied)
        inputs = notebook.metadata.get("sandkernel", {}).get("inputs")
        if isinstance(inputs, list):
            self.update_metadata(
                inputs=[i for i in inputs if isinstance(i, dict) and i.get("before_cell", 0) <= code_cells]
            )

    def record_input(self, path: str, data: bytes, sha256: str) -> None:
        """Note a file uploaded into the workspace, so a replay can put it back before the same
        cell. Files up to :data:`EMBED_INPUT_BYTES` are embedded (base64): the transcript is then
        self-contained; larger ones are named by size and SHA-256 (``sha256``, the caller's: it
        hashes off the event loop) and ``replay --file`` supplies them."""
        entry: dict[str, Any] = {
            "path": path,
            "size": len(data),
            "sha256": sha256,
            "before_cell": sum(1 for cell in self.notebook.cells if cell.cell_type == "code"),
        }
        encoded = (len(data) + 2) // 3 * 4
        room = self.full_cells_bytes - self._cells_bytes - self._inputs_bytes
        if len(data) <= EMBED_INPUT_BYTES and encoded <= room:
            entry["base64"] = base64.b64encode(data).decode()
            self._inputs_bytes += encoded
        inputs = [i for i in self.notebook.metadata["sandkernel"].get("inputs", []) if i["path"] != path]
        self.update_metadata(inputs=[*inputs, entry])

    def update_metadata(self, **values: Any) -> None:
        self.notebook.metadata["sandkernel"].update(values)
        self._mark_changed()

    async def flushed(self) -> None:
        """Wait until the file on disk holds everything recorded so far."""
        target = self._version
        async with self._written_cond:
            await self._written_cond.wait_for(lambda: self._written >= target)

    def _append(self, cell: nbformat.NotebookNode) -> None:
        """Append ``cell`` within the transcript's byte cap (see MAX_TRANSCRIPT_BYTES): whole while
        the cells take less than ``full_cells_bytes``, then with markers for its large outputs and
        a clipped source, and not at all once the cap is reached (the metadata counts those)."""
        used = self._cells_bytes + self._inputs_bytes
        if used + _estimate(cell) > self.full_cells_bytes:
            _shrink(cell)
        text = json.dumps(cell, sort_keys=True, indent=1, ensure_ascii=False)
        if used + len(text) > self.max_bytes * (1 - METADATA_RESERVE_SHARE):
            self._cells_not_recorded += 1
            self.update_metadata(
                transcript_cap={"max_bytes": self.max_bytes, "cells_not_recorded": self._cells_not_recorded}
            )
            return
        self.notebook.cells.append(cell)
        self._cells_json.append(text)
        self._cells_bytes += len(text) + 2
        self._mark_changed()

    def _mark_changed(self) -> None:
        self._version += 1
        self._changed.set()
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_behind())

    def document(self) -> str:
        """The transcript as its file holds it once written: the cells' JSON kept as each was
        recorded, joined (linear, no re-encoding of the notebook: cheap enough for the loop)."""
        return self._document()

    def _document(self) -> str:
        shell = dict(self.notebook)
        shell["cells"] = []
        head, tail = json.dumps(shell, sort_keys=True, indent=1, ensure_ascii=False).split('"cells": []', 1)
        return head + '"cells": [\n' + ",\n".join(self._cells_json) + "\n]" + tail + "\n"

    async def _write_behind(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            started = time.monotonic()
            version, text = self._version, self._document()
            await asyncio.to_thread(write_atomic, self.path, text, durable=False)
            async with self._written_cond:
                self._written = version
                self._written_cond.notify_all()
            # Each write rewrites the whole document: for a large notebook under a stream of
            # executes that would cost more and more. Pace writes so they take at most ~10% of
            # the time; the file still holds whole cells only, just coalesced into fewer writes.
            took = time.monotonic() - started
            if took > PACE_ABOVE_SECONDS:
                await asyncio.sleep(min(took * 9, MAX_PACE_SECONDS))
            try:  # fsync once the burst is over
                await asyncio.wait_for(self._changed.wait(), self.SYNC_DELAY)
            except asyncio.TimeoutError:
                await asyncio.to_thread(sync, self.path)

    async def close(self) -> None:
        """Write what is pending, make it durable, stop the writer task."""
        if self._writer is not None:
            await self.flushed()
            self._writer.cancel()
            self._writer = None
            await asyncio.to_thread(sync, self.path)

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)


def _read_own_notebook(path: Path) -> nbformat.NotebookNode:
    """A transcript this gateway wrote: a regular file (never followed through a link) of this
    user's, within the cap, that parses as a version 4 notebook. ValueError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError("not a regular file of this user's")
        data = f.read(MAX_TRANSCRIPT_BYTES * 2 + 1)
    if len(data) > MAX_TRANSCRIPT_BYTES * 2:
        raise ValueError("larger than any transcript sandkernel writes")
    notebook = nbformat.reads(data.decode(), as_version=4)
    if not isinstance(notebook.metadata.get("sandkernel"), dict):
        raise ValueError("not a sandkernel transcript")
    return notebook


def _estimate(cell: nbformat.NotebookNode) -> int:
    """About the bytes ``cell`` takes as JSON, without serialising it (it may hold 60 MB)."""
    source = cell.get("source", "")
    return len(source) + sum(output_size(o) for o in cell.get("outputs", [])) + 1024


def _shrink(cell: nbformat.NotebookNode) -> None:
    """A cell recorded past ``full_cells_bytes``: markers (size, SHA-256) for its large outputs,
    head and tail of its source. Stays valid nbformat."""
    for output in cell.get("outputs", []):
        replace_with_markers(output, "over the session transcript's cap")
    source = cell.get("source", "")
    if isinstance(source, str):
        cell["source"] = clip_chars(source, SOURCE_KEEP_CHARS, "source", "over the session transcript's cap")
