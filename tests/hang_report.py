"""Where a hung async test waits: every asyncio task's stack, printed shortly before
pytest-timeout fails the test (tests/conftest.py imports the hook).

pytest-timeout's own report shows the main thread only, which for an async test is the event
loop idling in ``select``: it says that the test hangs, not on which await. A test that hung
that way in a parallel rehearsal (an await with no deadline) could not be told apart from any
other. This prints each task's stack to the test's captured stderr ``REPORT_BEFORE`` seconds
before the timeout, so the failure report names the await.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator

import pytest

REPORT_BEFORE = 10.0  # seconds before pytest-timeout's deadline


def timeout_of(item: pytest.Item) -> float:
    """The test's pytest-timeout setting: its ``timeout`` mark, else the ini value (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:
        return 0.0


def await_chain(coro: object) -> Iterator[str]:
    """Where a suspended coroutine waits, outermost first, down its chain of awaits (a task's
    own stack stops at the outermost coroutine)."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            yield f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def print_tasks() -> None:
    """Every task of the running loop and the await it is suspended in (called on that loop)."""
    tasks = asyncio.all_tasks()
    print(f"\n[hang report] {len(tasks)} asyncio task(s) still waiting:", file=sys.stderr)
    for task in tasks:
        print(f"-- task {task.get_name()}:", file=sys.stderr)
        for line in await_chain(task.get_coro()):
            print(line, file=sys.stderr)


def report_running_loops() -> None:
    """From the timer thread: ask each running event loop to print its tasks."""
    for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]:
        if loop.is_running() and not loop.is_closed():
            loop.call_soon_threadsafe(print_tasks)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    timeout = timeout_of(item)
    timer = None
    if timeout > REPORT_BEFORE:
        timer = threading.Timer(timeout - REPORT_BEFORE, report_running_loops)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
