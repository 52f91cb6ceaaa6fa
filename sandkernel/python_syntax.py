"""Python syntax trees built safely beside other threads: every tree sandkernel builds comes from here.

CPython (3.11 here) counts the AST constructor's recursion depth in state that every thread of the
process shares. When a garbage collection inside one thread's ``ast.parse`` runs a finalizer that
lets another thread in, and that thread is building a tree too (a policy review and a replay's
reading of its cells, each in a worker thread; or any thread formatting a traceback, which parses
the failing line to place its carets), the count moves under the first thread, which then raises
``SystemError: AST constructor recursion depth mismatch`` for source that parses fine
(python/cpython#106905 and its reports). tests/test_python_syntax.py makes it happen on demand.

A tree is built with the garbage collector paused, so no finalizer can run, and so no other thread
can get in, in the middle of it: the build cannot be disturbed, whatever the other threads do.
Builds take turns under :data:`BUILDING` so that one build's end never turns the collector back on
under another's; the collector's own state (an operator may have turned it off) is put back.
"""

from __future__ import annotations

import ast
import gc
import threading
from collections.abc import Callable
from typing import Any, TypeVar

BUILDING = threading.Lock()
SPURIOUS_DEPTH_ERROR = "AST constructor recursion depth mismatch"  # what the race raises

T = TypeVar("T")


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, undisturbed by other threads (see the module docstring)."""
    return _undisturbed(lambda: ast.parse(source, filename=filename))


def literal_eval(text: str) -> Any:
    """``ast.literal_eval(text)``, undisturbed by other threads."""
    return _undisturbed(lambda: ast.literal_eval(text))


def _undisturbed(build: Callable[[], T]) -> T:
    with BUILDING:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return build()
        finally:
            if collecting:
                gc.enable()
