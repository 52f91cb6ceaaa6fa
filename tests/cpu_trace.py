"""Where the suite's CPU goes: a trace of the machine's busy CPU and of which tests ran when, and
the report that shares each second's CPU among the tests running in it.

Why: under load (a CPU hog on one core, as issue 29's budget run has) the suite is CPU-bound, so
its wall time follows the CPU its tests burn (the gateway's, the sandboxes', gVisor's ptrace
round trips), not their wall time on a quiet machine. Test-seconds (tests/tier_times.py) say how
long a test waited; this says what it cost everyone else.

Record (any run; off unless asked): ``SANDKERNEL_CPU_TRACE=DIR bash scripts/test.sh``. Every
pytest process that runs tests writes ``events-<worker>.tsv`` (start and end of each test, on
the machine-wide monotonic clock); the process that leads the run samples ``/proc/stat`` once a
second into ``cpu.tsv``. Report: ``python -m tests.cpu_trace DIR`` prints core-seconds per
module and the costliest tests. A second's CPU is shared among the tests that ran in it by
their overlap with it, so a test that waits while others compute is charged for part of their
work: the numbers rank, they do not bill.
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "SANDKERNEL_CPU_TRACE"
SAMPLE_SECONDS = 1.0
_events: list = []  # the open events file of this process, once tests/conftest.py registered the plugin


def busy_core_seconds() -> float:
    """Core-seconds the machine has spent busy since boot (everything but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _sample_forever(path: Path) -> None:
    with path.open("a", buffering=1) as out:
        while True:
            out.write(f"{time.monotonic():.3f}\t{busy_core_seconds():.2f}\n")
            time.sleep(SAMPLE_SECONDS)


def pytest_configure(config: pytest.Config) -> None:
    """Open this process's events file; the leading process also starts the sampler."""
    directory = os.environ[ENV]
    Path(directory).mkdir(parents=True, exist_ok=True)
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is None:  # the process that leads the run samples the machine
        threading.Thread(target=_sample_forever, args=(Path(directory) / "cpu.tsv",), daemon=True).start()
    if worker is not None or not config.getoption("numprocesses", None):  # a process that runs tests
        _events.append((Path(directory) / f"events-{worker or 'main'}.tsv").open("a", buffering=1))


def _note(kind: str, nodeid: str) -> None:
    if _events:
        _events[0].write(f"{kind}\t{time.monotonic():.3f}\t{nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _note("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    _note("end", nodeid)


def _intervals(directory: Path) -> list[tuple[float, float, str]]:
    """(start, end, nodeid) of every test that both started and ended in the trace."""
    spans = []
    for path in sorted(directory.glob("events-*.tsv")):
        began: dict[str, float] = {}
        for line in path.read_text().splitlines():
            kind, at, nodeid = line.split("\t", 2)
            if kind == "start":
                began[nodeid] = float(at)
            elif nodeid in began:
                spans.append((began.pop(nodeid), float(at), nodeid))
    return spans


def charge(directory: Path) -> tuple[dict[str, float], float]:
    """Core-seconds charged to each test, and the traced total."""
    samples = [tuple(map(float, line.split("\t"))) for line in (directory / "cpu.tsv").read_text().splitlines()]
    spans = sorted(_intervals(directory))
    charged: dict[str, float] = defaultdict(float)
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        overlaps = [(min(end, t1) - max(start, t0), nodeid) for start, end, nodeid in spans if start < t1 and end > t0]
        weight = sum(o for o, _ in overlaps)
        for overlap, nodeid in overlaps:
            charged[nodeid] += (c1 - c0) * overlap / weight
        if not overlaps:
            charged["(between tests)"] += c1 - c0
    return charged, samples[-1][1] - samples[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help=f"the directory ${ENV} named")
    parser.add_argument("--top", type=int, default=30, help="rows of each table")
    args = parser.parse_args()
    charged, total = charge(args.directory)
    modules: dict[str, float] = defaultdict(float)
    for nodeid, seconds in charged.items():
        modules[nodeid.split("::", 1)[0]] += seconds
    print(f"traced: {total:.0f} core-seconds busy ({total / 60:.1f} core-minutes)")
    print("\ncore-seconds per module")
    for module, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{seconds:8.0f}  {100 * seconds / total:5.1f}%  {module}")
    print("\ncostliest tests")
    for nodeid, seconds in sorted(charged.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{seconds:8.0f}  {nodeid}")


if __name__ == "__main__":
    main()
