"""How many tests each runtime holds in each tier: ``python -m tests.count_marks [pytest args]``,
from the repository root, collects the suite in-process (nothing runs, no engine is needed) and
prints a table of runtime (runc, runsc, none) by tier (docker, pure, security, slow).

Why: a change to how tests are marked or parametrised must not move tests between tiers or
runtimes; the table, taken before and after, shows at a glance that it did not. A test is docker
or pure (the two add up to the total); security and slow count the tests carrying those marks.
The runtime is the one the scheduler groups by (tests/conftest.py's ``runtime_of``).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections import Counter

import pytest

RUNTIMES = ("runc", "runsc", "none")
TIERS = ("docker", "pure", "security", "slow")


class Counts:
    """A pytest plugin: counts the collected tests once the suite's own collection hooks ran."""

    def __init__(self) -> None:
        self.cells: Counter[tuple[str, str]] = Counter()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        from .conftest import runtime_of  # the module pytest loaded as the suite's conftest

        for item in session.items:
            marks = {mark.name for mark in item.iter_markers()}
            runtime = runtime_of(item) or "none"
            self.cells[runtime, "docker" if "docker" in marks else "pure"] += 1
            for tier in ("security", "slow"):
                self.cells[runtime, tier] += tier in marks


def table(cells: Counter[tuple[str, str]]) -> str:
    """The counts as a text table, with a total column (docker + pure) and a total row."""
    rows = [("runtime", *TIERS, "total")]
    for runtime in (*RUNTIMES, "total"):
        wanted = RUNTIMES if runtime == "total" else (runtime,)
        row = [sum(cells[r, tier] for r in wanted) for tier in TIERS]
        rows.append((runtime, *map(str, row), str(row[0] + row[1])))
    return "\n".join(f"{first:8}" + "".join(f"{cell:>10}" for cell in rest) for first, *rest in rows)


def main(args: list[str]) -> int:
    counts = Counts()
    output = io.StringIO()
    with contextlib.redirect_stdout(output):  # pytest's own listing of every node id
        code = pytest.main(["--collect-only", "-q", *args], plugins=[counts])
    if code != pytest.ExitCode.OK:
        sys.stdout.write(output.getvalue())
        return int(code)
    print(table(counts.cells))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
