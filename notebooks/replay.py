"""Replay a notebook in a fresh sandbox, through the one execute path, and judge every cell.

Each code cell runs with :meth:`KernelSession.execute`, the path every door takes, so the
session's per-cell timeout ladder (interrupt → restart → replace), death and OOM detection
apply: a cell that kills its kernel is judged ``kernel died`` and the next cell runs on the
restarted kernel; a cell that never ends is judged ``timed out`` after ``timeout`` seconds and
the replay goes on. Every code cell gets one :class:`~sandkernel.notebooks.compare.Verdict`:
same, changed, new error, error gone, kernel died, timed out, or not run (past ``until``).

The notebook may come from anywhere nbformat can read (see :mod:`sandkernel.notebooks.repair`);
the replay is written beside it as ``NAME.replay.ipynb``, nbformat 4.5, valid, with sandkernel's
kernelspec and each cell's status and verdict in its metadata. Files the original session
uploaded are put back in the workspace before the cell they preceded.

:func:`run_replay_command` is the ``sandkernel replay`` command: it prints the verdicts, a
summary line and the replay's path, and returns the exit code (:data:`~sandkernel.notebooks.compare.EXIT_CODES`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import logging
import sys
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any, TextIO

import nbformat

from sandkernel.errors import ConfigError, SandkernelError
from sandkernel.kernels.execution.outputs import ExecutionResult, ExecutionStatus
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.catalog import choose_default_runtime
from sandkernel.kernels.sandbox.kernelspec import KERNEL_NAMES, kernel_json, kernel_name_for
from sandkernel.kernels.sandbox.workspace_files import WorkspaceFiles
from sandkernel.notebooks import repair
from sandkernel.notebooks.compare import (
    EXIT_BAD_INPUT,
    EXIT_SANDBOX_FAILED,
    CellVerdict,
    Verdict,
    compare_outputs,
    exit_code,
    format_report,
    load_rules,
)
from sandkernel.notebooks.transcript import result_to_cell, write_notebook_atomic

log = logging.getLogger(__name__)

# Seconds one cell may run before the timeout ladder stops it (``sandkernel replay --timeout``).
DEFAULT_CELL_TIMEOUT = 600.0
# What an original transcript's cell status must be for a replay's death or timeout to agree.
# The verdict note of a cell a resume does not re-run: its effects were lost with the kernel's state.
NOT_IN_MEMORY = "the kernel's state was lost after it: not in memory"
RECORDED_AS = {Verdict.KERNEL_DIED: {"kernel_died", "oom"}, Verdict.TIMED_OUT: {"timeout"}}


@dataclasses.dataclass(frozen=True)
class Upload:
    """A file the original session put in the workspace before its ``before_cell``-th code cell."""

    before_cell: int
    path: str
    data: bytes


@dataclasses.dataclass(frozen=True)
class ReplayOutcome:
    """What a replay did: where the replayed notebook is, each code cell's verdict, and the
    sentences about the input (conversions, repairs, what was left out)."""

    path: Path
    verdicts: list[CellVerdict]
    notes: list[str]
    runtime: str


async def replay(
    path: Path,
    until: int | None = None,
    runtime: str | None = None,
    profile: str | None = None,
    rules_file: str | None = None,
    timeout: float = DEFAULT_CELL_TIMEOUT,
    files: list[Path] | None = None,
) -> ReplayOutcome:
    """Replay the notebook at ``path`` (its first ``until`` code cells; all by default).

    ``runtime`` is runc, runsc or auto; None means the runtime the transcript recorded
    (``metadata.sandkernel.runtime``, so a session replays as it ran), else $SANDKERNEL_RUNTIME,
    else auto (gVisor where registered). ``timeout`` is per cell, in seconds. Raises
    :class:`ConfigError` for bad input (before any sandbox starts) and other
    :class:`SandkernelError`\\ s when the sandbox fails; never for what the cells do."""
    if until is not None and (isinstance(until, bool) or not isinstance(until, int) or until < 0):
        raise ConfigError(f"--until must be a number of code cells, 0 or more, not {until!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise ConfigError(f"--timeout must be seconds per cell, above 0 and at most 86400, not {timeout!r}")
    try:
        rules = load_rules(rules_file)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot use the rules file {rules_file}: {err}") from err
    original, notes = repair.load_notebook(path)
    uploads = _uploads_of(original, files or [], notes)
    chosen = (await choose_default_runtime(runtime or _recorded_runtime(original))).value
    async with await KernelSession.start(profile=profile, overrides={"runtime": chosen}) as session:
        cells, verdicts = await _run_cells(session, original, uploads, until, timeout, rules, notes)
        sandbox = session.describe()
    target = path.with_name(path.name.removesuffix(".ipynb") + ".replay.ipynb")
    replayed = _replay_notebook(path, original, cells, verdicts, sandbox, until, timeout, notes)
    try:
        write_notebook_atomic(replayed, target)
    except nbformat.ValidationError as error:  # every piece was validated: this would be our bug
        raise SandkernelError(f"the replay of {path.name} does not validate, not written: {error.message}") from error
    except OSError as error:
        raise ConfigError(f"cannot write the replay {target}: {error}") from error
    return ReplayOutcome(target, verdicts, notes, chosen)


def _recorded_runtime(notebook: nbformat.NotebookNode) -> str | None:
    """The runtime a sandkernel transcript says its session ran on, if it names a known one."""
    recorded = notebook.metadata.get("sandkernel")
    runtime = recorded.get("runtime") if isinstance(recorded, dict) else None
    return runtime if runtime in KERNEL_NAMES.values() else None


def replay_notebook(
    path: Path,
    until: int | None = None,
    kernel_name: str | None = None,
    rules_file: str | None = None,
    timeout: float = DEFAULT_CELL_TIMEOUT,
    files: list[Path] | None = None,
    runtime: str | None = None,
) -> tuple[Path, list[CellVerdict]]:
    """:func:`replay` for callers without an event loop: the replay's path and the verdicts.
    ``kernel_name`` (sandkernel-python or sandkernel-python-gvisor) is another way to say the runtime."""
    if kernel_name is not None:
        if kernel_name not in KERNEL_NAMES:
            raise ConfigError(f"unknown kernel {kernel_name!r}; use one of {sorted(KERNEL_NAMES)}")
        runtime = runtime or KERNEL_NAMES[kernel_name]
    outcome = asyncio.run(replay(path, until, runtime, None, rules_file, timeout, files))
    return outcome.path, outcome.verdicts


def run_replay_command(
    notebook: str,
    until: int | None = None,
    runtime: str | None = None,
    profile: str | None = None,
    rules_file: str | None = None,
    timeout: float | None = None,
    files: list[str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``sandkernel replay``: print the notes, each cell's verdict, the summary and the replay's
    path to ``out``, problems to ``err``; return an exit code of :data:`~sandkernel.notebooks.compare.EXIT_CODES`."""
    out, err = out or sys.stdout, err or sys.stderr
    timeout = DEFAULT_CELL_TIMEOUT if timeout is None else timeout
    try:
        outcome = asyncio.run(
            replay(Path(notebook), until, runtime, profile, rules_file, timeout, [Path(f) for f in files or []])
        )
    except ConfigError as error:
        print(f"sandkernel: {error}", file=err)
        return EXIT_BAD_INPUT
    except SandkernelError as error:
        print(f"sandkernel: the replay could not run: {error}", file=err)
        return EXIT_SANDBOX_FAILED
    for note in outcome.notes:
        print(f"note: {note}", file=out)
    print(format_report(outcome.verdicts), file=out)
    print(f"replayed notebook ({outcome.runtime}): {outcome.path}", file=out)
    return exit_code(outcome.verdicts)


def _uploads_of(notebook: nbformat.NotebookNode, files: list[Path], notes: list[str]) -> list[Upload]:
    """Each file the session uploaded (``metadata.sandkernel.inputs``), from the transcript when
    embedded, else from ``files`` (matched by workspace path or name). A file neither holds is
    a ConfigError naming it; a malformed entry is skipped with a note."""
    supplied = {local.name: local for local in files}
    entries = notebook.metadata.get("sandkernel", {})
    entries = entries.get("inputs", []) if isinstance(entries, dict) else []
    found = []
    for entry in entries if isinstance(entries, list) else []:
        try:
            workspace_path, digest, before = str(entry["path"]), str(entry["sha256"]), int(entry.get("before_cell", 0))
        except (TypeError, KeyError, ValueError):
            notes.append(f"metadata.sandkernel.inputs has an entry that names no file and hash: {str(entry)[:80]}")
            continue
        local = supplied.get(workspace_path) or supplied.get(Path(workspace_path).name)
        if local is not None:
            try:
                data = local.read_bytes()
            except OSError as error:
                raise ConfigError(f"cannot read {local}: {error}") from error
            if hashlib.sha256(data).hexdigest() != digest:
                notes.append(f"{local} differs from the file the session used ({workspace_path})")
        elif "base64" in entry:
            try:
                data = base64.b64decode(entry["base64"], validate=True)
            except (binascii.Error, TypeError, ValueError):
                raise ConfigError(f"the embedded copy of {workspace_path} is not valid base64") from None
        else:
            raise ConfigError(
                f"this notebook needs the file {workspace_path} ({entry.get('size', '?')} bytes, sha256 "
                f"{digest[:12]}…), too large to be embedded: pass it with --file"
            )
        found.append(Upload(before, workspace_path, data))
    return found


async def _run_cells(
    session: KernelSession,
    original: nbformat.NotebookNode,
    uploads: list[Upload],
    until: int | None,
    timeout: float,
    rules: list[tuple[str, str]],
    notes: list[str],
    only: Collection[int] | None = None,
) -> tuple[list[dict[str, Any]], list[CellVerdict]]:
    """Run the code cells in order; return the replay's cells (all kinds, valid) and verdicts.
    ``only``: the indexes of the code cells to run (a resume runs those whose effects are in the
    kernel's memory; the others are judged "not run" with :data:`NOT_IN_MEMORY`); None: all."""
    cells: list[dict[str, Any]] = []
    verdicts: list[CellVerdict] = []
    taken: set[str] = set()
    missing_ids = 0
    lost: tuple[int, str | None] = (0, None)  # the last cell at which the kernel's state was lost, and why
    for position, cell in enumerate(original.cells, start=1):
        if not isinstance(cell, dict):
            notes.append(f"cell {position} is not a cell ({type(cell).__name__}); left out")
            continue
        new_id, renamed = repair.cell_id(cell, taken)
        if renamed and "id" not in cell:
            missing_ids += 1
        elif renamed:
            notes.append(f"cell {position}: its id {str(cell['id'])[:40]!r} was invalid or repeated; given {new_id}")
        if cell.get("cell_type") != "code":
            if cell.get("cell_type") not in ("markdown", "raw"):
                notes.append(f"cell {position}: unknown cell type {str(cell.get('cell_type'))[:40]!r}, kept as raw")
            cells.append(repair.valid_cell(repair.copied_cell(cell, new_id), f"cell {position}", notes))
            continue
        index = len(verdicts) + 1
        code = repair.source_of(cell)
        if until is not None and index > until:
            verdict = CellVerdict(index, Verdict.NOT_RUN)
            replayed = _unrun_cell(code, cell, new_id)
        elif only is not None and index not in only:
            verdict = CellVerdict(index, Verdict.NOT_RUN, note=NOT_IN_MEMORY)
            replayed = _unrun_cell(code, cell, new_id)
        elif _recorded(cell).get("status") == ExecutionStatus.REFUSED.value:
            # A gate refused it in the original session: it never ran then, so it is not run now.
            verdict = CellVerdict(index, Verdict.NOT_RUN, note="refused when recorded: it never ran")
            replayed = _unrun_cell(code, cell, new_id)
        else:
            for upload in uploads:
                if upload.before_cell == index - 1:
                    await WorkspaceFiles(session.container).write(upload.path, upload.data)
                    if session.meter is not None:  # the upload is not the cell's doing
                        session.meter.forget_files()
            result = await session.execute(code, timeout=timeout, source="replay")
            if result.state_lost and result.state_lost != lost[1]:
                lost = (index, result.state_lost)
            verdict = judge(index, cell, result, rules, timeout, lost if lost[0] else None)
            replayed = dict(result_to_cell(code, result, source="replay"))
            replayed["id"] = new_id
            replayed["metadata"] = {**repair.cell_metadata(cell), **replayed["metadata"]}
        replayed["metadata"].setdefault("sandkernel", {})["replay_verdict"] = verdict.verdict.value
        log.info("replayed cell %d: %s", index, verdict.verdict.value)
        verdicts.append(verdict)
        cells.append(repair.valid_cell(replayed, f"code cell {index}", notes))
    if missing_ids:
        notes.append(f"{missing_ids} cells had no id (nbformat before 4.5); the replay gives every cell one")
    return cells, verdicts


def _recorded(cell: dict[str, Any]) -> dict[str, Any]:
    """What the original session recorded of a cell (``metadata.sandkernel``), or {} (any
    notebook may be replayed: the field may be missing or of any type)."""
    metadata = cell.get("metadata")
    recorded = metadata.get("sandkernel") if isinstance(metadata, dict) else None
    return recorded if isinstance(recorded, dict) else {}


def _unrun_cell(code: str, cell: dict[str, Any], new_id: str) -> dict[str, Any]:
    return {
        "cell_type": "code",
        "id": new_id,
        "source": code,
        "outputs": [],
        "execution_count": None,
        "metadata": {**repair.cell_metadata(cell), "sandkernel": {}},
    }


def judge(
    index: int,
    original: dict[str, Any],
    result: ExecutionResult,
    rules: list[tuple[str, str]],
    timeout: float,
    lost: tuple[int, str | None] | None = None,
) -> CellVerdict:
    """The verdict for code cell ``index``: the replay's death or timeout first (with whether
    the original transcript recorded the same), else its outputs compared with the original's.
    ``lost`` (cell, sentence) is the last loss of the kernel's state: a difference after it
    says so, since a later NameError is then the restart's doing, not the cell's."""
    recorded_status = _recorded(original).get("status")
    if result.status in (ExecutionStatus.KERNEL_DIED, ExecutionStatus.OOM, ExecutionStatus.TIMEOUT):
        if result.status is ExecutionStatus.TIMEOUT:
            verdict = Verdict.TIMED_OUT
            rung = result.ended_by.value if result.ended_by else "the timeout ladder"
            note = f"still running after {timeout:g}s; stopped by {rung}"
        else:
            verdict = Verdict.KERNEL_DIED
            note = "out of memory" if result.status is ExecutionStatus.OOM else "the kernel process ended"
            note += "; the next cell runs on a restarted kernel"
        as_recorded = recorded_status in RECORDED_AS[verdict]
        return CellVerdict(
            index, verdict, note=note + ("; as in the original" if as_recorded else ""), as_recorded=as_recorded
        )
    verdict = compare_outputs(index, original.get("outputs"), list(result.outputs), rules)
    if verdict.verdict is not Verdict.SAME and lost is not None:
        extra = f"kernel state lost at cell {lost[0]}: {lost[1]}"
        verdict = dataclasses.replace(verdict, note=f"{verdict.note}; {extra}" if verdict.note else extra)
    return verdict


def _replay_notebook(
    path: Path,
    original: nbformat.NotebookNode,
    cells: list[dict[str, Any]],
    verdicts: list[CellVerdict],
    sandbox: dict[str, Any],
    until: int | None,
    timeout: float,
    notes: list[str],
) -> nbformat.NotebookNode:
    """The replayed notebook: valid cells, sandkernel's kernelspec, and what the replay did."""
    name = kernel_name_for(sandbox["runtime"])
    spec = kernel_json(name)
    recorded = original.metadata.get("sandkernel")
    recorded = recorded if isinstance(recorded, dict) else {}
    if "widgets" in original.metadata:
        notes.append("the original's widget state (metadata.widgets) was not copied: the replay's widgets are new")
    own = {
        "kernelspec": {"name": name, "display_name": spec["display_name"], "language": spec["language"]},
        "language_info": {"name": "python"},
        "sandkernel": {
            **sandbox,
            **({"inputs": recorded["inputs"]} if isinstance(recorded.get("inputs"), list) else {}),
            "replay": {
                "of": path.name,
                "original_session_id": recorded.get("session_id"),
                "until": until,
                "cell_timeout": timeout,
                "verdicts": dict(Counter(v.verdict.value for v in verdicts)),
                "notes": notes,
            },
        },
    }
    return repair.new_notebook(cells, repair.valid_metadata(own, dict(original.metadata), notes))
