"""What each tier of the suite cost, printed at the end of every run (tests/conftest.py imports
these hooks): the summed time of its tests (set-up and tear-down included) per tier, so a change
that makes one tier slower shows in every CI log, next to the run's wall time.

Tiers: ``pure`` (no Docker), ``runc`` and ``runsc`` (container tests by runtime; a container test
with no runtime parameter counts as runc, the runtime every machine has), and ``cluster`` (the
Swarm lab's modules, whatever their runtime, in a parallel run). With xdist the reports reach the controller, which
prints; the sums are test-seconds, not wall time (several workers run at once).
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

TIERS = ("pure", "runc", "runsc", "cluster")
CLUSTER_GROUP = "swarm-lab"

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, set[str]] = defaultdict(set)
_started = time.monotonic()


def tier_of(report: pytest.TestReport) -> str:
    """The tier of a test, from the marks its report carries (they survive the trip from a worker)."""
    if report.nodeid.endswith(f"@{CLUSTER_GROUP}"):  # xdist's group suffix (a serial run has none)
        return "cluster"
    if "docker" not in report.keywords:
        return "pure"
    return "runsc" if "runsc" in report.keywords else "runc"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = tier_of(report)
    _seconds[tier] += report.duration
    _tests[tier].add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _tests:
        return  # a worker: the controller prints
    terminalreporter.section("time per tier (test-seconds, set-up and tear-down included)")
    for tier in TIERS:
        if _tests[tier]:
            terminalreporter.write_line(f"{tier:8} {len(_tests[tier]):5} tests {_seconds[tier]:8.0f} s")
    terminalreporter.write_line(f"{'wall':8} {sum(len(t) for t in _tests.values()):5} tests "
                                f"{time.monotonic() - _started:8.0f} s (pytest's own wall time)")
