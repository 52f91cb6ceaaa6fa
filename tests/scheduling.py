"""How the suite runs in parallel: pytest-xdist workers (``-n N --dist loadgroup``, as
scripts/test.sh runs it), the groups that keep a module's shared sandboxes on one worker, and the
lock that gives a test that disturbs the whole machine the machine to itself.

Why parallel: most of a container test's wall time is spent waiting (a sandbox starting, a
kernel answering, gVisor's ptrace round trips), not computing, so a few workers on two cores
finish the suite in a fraction of the serial time.

Groups. Every test lands in an ``xdist_group`` before xdist reads the marks: a test that names
one itself (``pytestmark = pytest.mark.xdist_group(...)``: the Swarm lab's modules share one
lab's namespaces and addresses, so they share a group and run one after another) keeps it;
any other test of a module that holds docker tests goes to the group of its module and its
runtime (``tests/test_x.py::runc``), so a module-scoped sandbox or gateway is made once per
runtime, on one worker, as in a serial run. Pure modules are left ungrouped: their tests are
spread one by one.

Order. The queue holds the longest groups first, by what the last measured run took
(tests/durations.json, regenerated with ``python -m tests.scheduling REPORT.xml`` from a run's
``--junitxml`` report): a long group started near the end would keep one worker busy while the
others had nothing left (:func:`order_for_workers`).

Exclusive tests. A test marked ``exclusive`` runs while no other test of the run does (its
set-up and tear-down included): the dockerd restart stops the engine every other test talks to.
Each test holds a shared lock on a file in the run's base temp dir for its whole protocol; an exclusive
test takes it exclusively. A second lock (the gate) is taken by every test for a moment before
its shared lock and by an exclusive test for its whole run, so an exclusive test waiting for the
others to finish is not starved by tests that keep starting. Such a test is queued last
(:func:`order_for_workers`): at the gate early, it would hold every other worker idle until the
longest test then running (the Swarm lab's, minutes) had finished. Outside xdist nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest

GROUP_MARK = "xdist_group"
EXCLUSIVE_MARK = "exclusive"


def group_of(module: str, runtime: str | None) -> str:
    """The xdist group of a test of ``module`` (a path relative to the repository) run under
    ``runtime`` (None: the test has no runtime parameter). No brackets: xdist takes a node id
    ending in ``]`` for an ungrouped test, whatever its ``@group`` suffix says."""
    return f"{module}::{runtime}" if runtime else module


def assign_groups(items: list[pytest.Item], module_of, runtime_of, is_docker) -> None:
    """Give every test of a module that holds docker tests its group (see the module docstring);
    called from tests/conftest.py's collection hook, before xdist turns marks into scopes."""
    docker_modules = {module_of(item) for item in items if is_docker(item)}
    for item in items:
        module = module_of(item)
        if module in docker_modules and item.get_closest_marker(GROUP_MARK) is None:
            item.add_marker(pytest.mark.xdist_group(group_of(module, runtime_of(item))))


def name_groups_in_node_ids(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker with ``--dist loadgroup``, put the tests in the queue's order
    (:func:`order_for_workers`) and end each grouped test's node id with
    ``@group``, which is how the controller's scheduler sees groups. xdist 3.8 does this itself by
    writing ``item._nodeid``, which pytest 9.2 no longer reads (the id is ``item._id``, a NodeId):
    without this every test was scheduled alone, each worker made its own copy of every
    module-scoped sandbox, and the Swarm lab's modules ran on several workers at once."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers only
        return  # a serial run keeps pytest's own order
    order_for_workers(items)
    for item in items:
        group = group_name(item)
        if group is None or item.nodeid.endswith(f"@{group}"):
            continue
        if hasattr(item, "_id"):
            from _pytest.nodeid import NodeId  # pytest 9.2 and later

            item._id = NodeId.parse(f"{item.nodeid}@{group}")  # the id pytest reads
        else:
            item._nodeid = f"{item.nodeid}@{group}"  # older pytest reads this; xdist writes it too


def group_name(item: pytest.Item) -> str | None:
    """The item's xdist group, as xdist will read it (None: ungrouped)."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers(GROUP_MARK)})
    return "_".join(names) if names else None


def order_for_workers(items: list[pytest.Item], expected: dict[str, float] | None = None) -> None:
    """Order the tests as the workers should take them (xdist's own reordering by group size is
    turned off in :func:`pytest_configure`, so this order is the queue's): the longest work first,
    so no long group starts near the end while the other workers run out of work (a bench run of
    four minutes started last held a whole run up). A group's length is what the last measured
    run took (:data:`DURATIONS_FILE`, from :func:`write_durations`), or, for a group it does not
    know, its number of tests times :data:`UNKNOWN_TEST_SECONDS`. Groups holding an exclusive test
    go last, so such a test waits only for the short tests still running at the end, not while
    every other worker sits at the gate. Tests keep pytest's order within a group (the order that
    makes each module-scoped fixture once)."""
    expected = read_durations() if expected is None else expected
    seconds: dict[str, float] = {}
    exclusive: set[str] = set()
    for item in items:
        group = group_name(item) or item.nodeid
        seconds[group] = seconds.get(group, 0.0) + expected.get(test_key(item), UNKNOWN_TEST_SECONDS)
        if item.get_closest_marker(EXCLUSIVE_MARK) is not None:
            exclusive.add(group)

    def rank(item: pytest.Item) -> tuple[bool, float, str]:
        group = group_name(item) or item.nodeid
        return (group in exclusive, -seconds[group], group)

    items.sort(key=rank)


# What each test took in a full run (set-up and tear-down included), by test_key: generated by
# ``python -m tests.scheduling REPORT.xml`` from a run's JUnit report (pytest --junitxml), so the
# queue's order follows what the tests cost, not a hand-kept list. A test it does not list counts
# as UNKNOWN_TEST_SECONDS.
DURATIONS_FILE = Path(__file__).with_name("durations.json")
UNKNOWN_TEST_SECONDS = 2.0


def test_key(item: pytest.Item) -> str:
    """A test's node id without xdist's ``@group`` suffix."""
    nodeid = item.nodeid
    group = group_name(item)
    return nodeid.removesuffix(f"@{group}") if group else nodeid


def read_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def write_durations(report: Path, path: Path = DURATIONS_FILE) -> int:
    """Write the durations of a JUnit report's tests (rounded to 0.1 s); the number written."""
    durations: dict[str, float] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        nodeid = f"{module}.py::{case.get('name', '')}".split("@", 1)[0]
        durations[nodeid] = durations.get(nodeid, 0.0) + float(case.get("time", 0))
    path.write_text(json.dumps({k: round(v, 1) for k, v in sorted(durations.items())}, indent=0) + "\n")
    return len(durations)


def pytest_configure(config: pytest.Config) -> None:
    """Keep the queue in :func:`order_for_workers`' order (xdist would sort groups by size)."""
    if getattr(config.option, "dist", None) == "loadgroup":
        config.option.loadscopereorder = False


def lock_dir(config: pytest.Config) -> Path | None:
    """Where this run's lock files live, or None outside an xdist worker (nothing to lock): the
    run's own base temp dir, which every worker's sits in (``.../popen-gwN``) and which pytest's
    retention removes with the run, so no lock file outlives a few runs."""
    if getattr(config, "workerinput", None) is None or not config.option.basetemp:
        return None
    return Path(config.option.basetemp).parent


@contextlib.contextmanager
def machine_share(config: pytest.Config, exclusive: bool) -> Iterator[None]:
    """Hold this run's shared lock (or, for an exclusive test, both locks) around one test."""
    folder = lock_dir(config)
    if folder is None:
        yield
        return
    gate = os.open(folder / "exclusive-gate", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    share = os.open(folder / "exclusive-share", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(share, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(share)  # closing drops the locks
        os.close(gate)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with machine_share(item.config, exclusive=item.get_closest_marker(EXCLUSIVE_MARK) is not None):
        yield


if __name__ == "__main__":
    written = write_durations(Path(sys.argv[1]))
    print(f"{written} tests' durations written to {DURATIONS_FILE}")
