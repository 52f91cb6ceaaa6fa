"""Syntax trees built beside other threads' trees (sandkernel/python_syntax.py): CPython's shared
recursion count makes a plain ``ast.parse`` fail spuriously when another thread is in the middle of
building a tree; sandkernel's never does. Pure: no Docker."""

from __future__ import annotations

import ast
import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandkernel import python_syntax

LONG = Path(ast.__file__).read_text()  # many allocations: collections land inside its parse
CELL = "x = [(1, 2), {3: 4}]\nprint(x)"
BOUND = 60.0  # seconds a phase may take (the plain parse's first failures came within 3 s here)


class GilReleasingFinalizer:
    """Garbage whose collection lets another thread in, as any finalizer doing I/O does."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(0)


def cells_parsed_beside_a_long_parse(parse: Callable[[str], object], enough: Callable[[int, int], bool]) -> int:
    """A thread parses CELL with ``parse`` again and again while this one builds LONG's tree with
    plain ``ast.parse`` (as any thread formatting a traceback would), amid frequent collections,
    until ``enough(cells parsed, their spurious failures)``; returns the failures."""
    parsed, failed = 0, 0
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

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    cells = threading.Thread(target=parse_cells, daemon=True)
    cells.start()
    deadline = time.monotonic() + BOUND
    try:
        while not enough(parsed, failed):
            assert time.monotonic() < deadline, f"not enough within {BOUND:g}s: {parsed} cells, {failed} failed"
            GilReleasingFinalizer()
            ast.parse(LONG)
            time.sleep(0.001)  # the cells' thread gets its turns between long parses too
    finally:
        stop.set()
        cells.join(10)
        gc.set_threshold(*thresholds)
    return failed


def test_a_cell_parsed_beside_another_threads_long_parse_never_fails_spuriously():
    seen: list[int] = []

    def three_failures(parsed: int, failed: int) -> bool:
        seen[:] = [parsed]
        return failed >= 3

    cells_parsed_beside_a_long_parse(ast.parse, three_failures)  # the race is live here: plain parses fail
    plain_cells = seen[0]
    failed = cells_parsed_beside_a_long_parse(python_syntax.parse, lambda parsed, _: parsed >= 3 * plain_cells)
    print(f"plain: 3 failures in {plain_cells} cells")
    assert failed == 0, f"{failed} of sandkernel's parses failed where plain ones failed 3 times in {plain_cells}"


def test_a_real_syntax_error_is_still_raised():
    try:
        python_syntax.parse("def (")
    except SyntaxError:
        pass
    else:
        raise AssertionError("a syntax error was not raised")
    assert python_syntax.literal_eval("'a'") == "a"
