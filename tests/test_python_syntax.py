"""Syntax trees built beside other threads' trees (sandkernel/python_syntax.py): CPython's shared
recursion count makes a plain ``ast.parse`` fail spuriously when another thread is in the middle of
building a tree; sandkernel's never does. Pure: no Docker.

The race runs in a child process with a hard deadline: at its worst it does not fail but hangs a
plain parse, holding the GIL in C code and growing without end (a sixteenth-session rehearsal: a
worker at 100% CPU and 2.8 GiB for 8 minutes, which no in-process deadline could stop)."""

from __future__ import annotations

import ast
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandkernel import python_syntax

from .conftest import ROOT

LONG = Path(ast.__file__).read_text()  # many allocations: collections land inside its parse
CELL = "x = [(1, 2), {3: 4}]\nprint(x)"
BOUND = 60.0  # seconds a phase may take (the plain parse's first failures came within 3 s here)


class GilReleasingFinalizer:
    """Garbage whose collection lets another thread in, as any finalizer doing I/O does."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(0)


def cells_parsed_beside_a_long_parse(parse: Callable[[str], object], enough: Callable[[int, int], bool]) -> dict:
    """A thread parses CELL with ``parse`` again and again while this one builds LONG's tree with
    plain ``ast.parse`` (as any thread formatting a traceback would), amid frequent collections,
    until ``enough(cells parsed, their spurious failures)``: the counts, and how often this
    thread's own plain parse failed (CPython's race, not the cells' parse)."""
    parsed, failed, long_failed = 0, 0, 0
    stop = threading.Event()

    def parse_cells() -> None:
        nonlocal parsed, failed
        while not stop.is_set():
            GilReleasingFinalizer()
            try:
                parse(CELL)
            except SystemError as err:
                assert python_syntax.SPURIOUS_DEPTH_ERROR in str(err), err
                failed += 1
            parsed += 1

    gc.set_threshold(50, 1, 1)
    cells = threading.Thread(target=parse_cells, daemon=True)
    cells.start()
    deadline = time.monotonic() + BOUND
    try:
        while not enough(parsed, failed):
            assert time.monotonic() < deadline, f"not enough within {BOUND:g}s: {parsed} cells, {failed} failed"
            GilReleasingFinalizer()
            try:
                ast.parse(LONG)
            except SystemError:
                long_failed += 1
            time.sleep(0.001)  # the cells' thread gets its turns between long parses too
    finally:
        stop.set()
        cells.join(10)
    return {"parsed": parsed, "failed": failed, "long_failed": long_failed}


def plain_phase() -> dict:
    """Plain parses on both threads, until the cells' thread failed 3 times."""
    return cells_parsed_beside_a_long_parse(ast.parse, lambda parsed, failed: failed >= 3)


def sandkernel_phase(cells: int) -> dict:
    """sandkernel's parse on the cells' thread, for ``cells`` cells."""
    return cells_parsed_beside_a_long_parse(python_syntax.parse, lambda parsed, _: parsed >= cells)


def in_a_child(call: str) -> dict | None:
    """``call`` (an expression over this module) in a child process: its result, or None when the
    child had not finished within the phase's bound and was killed."""
    code = f"import json; from tests.test_python_syntax import *; print(json.dumps({call}))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=BOUND + 30
        )
    except subprocess.TimeoutExpired:
        return None
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cell_parsed_beside_another_threads_long_parse_never_fails_spuriously():
    plain = in_a_child("plain_phase()")
    # The race is live here: plain parses fail, or (its worst) one hangs and the child is killed.
    plain_cells = 300 if plain is None else plain["parsed"]
    ours = in_a_child(f"sandkernel_phase({3 * plain_cells})")
    print(f"plain: {plain or 'hung'}; sandkernel's: {ours}")
    assert ours is not None, "sandkernel's parses did not finish: a parse hung"
    assert ours["failed"] == 0, f"{ours['failed']} of sandkernel's parses failed where plain ones failed 3 times"


def test_a_real_syntax_error_is_still_raised():
    try:
        python_syntax.parse("def (")
    except SyntaxError:
        pass
    else:
        raise AssertionError("a syntax error was not raised")
    assert python_syntax.literal_eval("'a'") == "a"
