"""The suite's own guards: with ``SANDKERNEL_REQUIRE_RUNSC=1`` no runsc test may pass by being
skipped. The machine state that triggers the guard (gVisor missing) cannot be made for real on
a machine that has it, so the decision is a pure function, tested here for every state; the
real state of this machine is checked too. And no test may lack the tier marks its fixtures,
parameters or folder call for: planted tests without them are reported."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import (
    REQUIRE_RUNSC_ENV,
    ROOT,
    RUNTIME_PARAMS,
    RUNTIMES,
    RunscState,
    Verdict,
    missing_marks,
    pytest_collection_modifyitems,
    require_runtime,
    runsc_required,
    runsc_state,
    runsc_verdict,
    skip_forbidden,
)


@pytest.mark.parametrize(
    ("state", "required", "verdict"),
    [
        (RunscState.REGISTERED, False, Verdict.RUN),
        (RunscState.REGISTERED, True, Verdict.RUN),
        (RunscState.NOT_REGISTERED, False, Verdict.FAIL),
        (RunscState.NOT_REGISTERED, True, Verdict.FAIL),
        (RunscState.NOT_INSTALLED, False, Verdict.SKIP),
        (RunscState.NOT_INSTALLED, True, Verdict.FAIL),
    ],
)
def test_runsc_verdict(state, required, verdict):
    found, reason = runsc_verdict(state, required)
    assert found is verdict, reason
    if found is Verdict.FAIL and state is RunscState.NOT_INSTALLED:
        assert REQUIRE_RUNSC_ENV in reason and "host-setup.sh" in reason


@pytest.mark.parametrize(("value", "required"), [(None, False), ("", False), ("0", False), ("1", True)])
def test_require_runsc_is_read_at_call_time(monkeypatch, value, required):
    if value is None:
        monkeypatch.delenv(REQUIRE_RUNSC_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_RUNSC_ENV, value)
    assert runsc_required() is required


@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_an_unclear_require_runsc_value_is_refused(monkeypatch, value):
    monkeypatch.setenv(REQUIRE_RUNSC_ENV, value)
    with pytest.raises(ValueError, match="must be 1 or 0"):
        runsc_required()


def test_only_runsc_skips_are_forbidden_and_only_when_required():
    assert skip_forbidden("tests/security/test_escape.py::test_x[runsc-bpf]", True)
    assert not skip_forbidden("tests/security/test_escape.py::test_x[runsc-bpf]", False)
    assert not skip_forbidden("tests/test_egress.py::test_x[runc]", True)


@pytest.mark.docker  # asks the engine which runtimes it has
def test_this_machine_agrees_with_its_runsc_binary(monkeypatch):
    """Where runsc is installed here, it is registered, and the guard lets its tests run even
    when required; where it is not, requiring it fails the test instead of skipping it."""
    monkeypatch.setenv(REQUIRE_RUNSC_ENV, "1")
    if shutil.which("runsc"):
        assert runsc_state() is RunscState.REGISTERED
        require_runtime("runsc")  # neither skips nor fails
    else:
        with pytest.raises(pytest.fail.Exception, match=REQUIRE_RUNSC_ENV):
            require_runtime("runsc")


@dataclass
class Planted:
    """A stand-in for a collected test: what the marks check reads of one."""

    nodeid: str
    fixturenames: tuple[str, ...] = ()
    params: dict[str, object] | None = None
    marks: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return ROOT / self.nodeid.split("::")[0]

    @property
    def callspec(self) -> SimpleNamespace | None:
        return None if self.params is None else SimpleNamespace(params=self.params)

    def iter_markers(self) -> Iterator[pytest.Mark]:
        return iter([getattr(pytest.mark, name).mark for name in self.marks])


def test_a_test_without_the_marks_it_needs_is_reported():
    cases = [
        (Planted("tests/test_x.py::test_a", ("tmp_path",)), []),
        (Planted("tests/test_x.py::test_b", ("kernel_session", "request")), ["docker"]),
        (Planted("tests/test_x.py::test_c", ("sandkernel", "gateway"), marks=("docker",)), []),
        (Planted("tests/test_x.py::test_d[runsc]", params={"runtime": "runsc"}), ["docker", "runsc"]),
        (Planted("tests/test_x.py::test_e[runsc]", params={"runtime": "runsc"}, marks=("docker",)), ["runsc"]),
        (Planted("tests/test_x.py::test_f[runc-1]", params={"runtime": "runc", "n": 1}, marks=("docker",)), []),
        (Planted("tests/security/test_y.py::test_g"), ["security"]),
        (Planted("tests/security/test_y.py::test_h[runc]", ("arena",), {"runtime": "runc"}, ("docker", "security")),
         []),
    ]
    assert [missing_marks(item) for item, _ in cases] == [missing for _, missing in cases]
    with pytest.raises(pytest.UsageError) as refused:
        pytest_collection_modifyitems(None, [item for item, _ in cases])
    for item, missing in cases:
        assert (f"{item.nodeid}: add {', '.join(missing)}" in str(refused.value)) is bool(missing), item.nodeid
    # The runtime parameters carry the marks, under the runtimes' names as ids.
    assert [(p.values, p.id, [m.name for m in p.marks]) for p in RUNTIME_PARAMS] == [
        (("runc",), "runc", ["docker"]), (("runsc",), "runsc", ["docker", "runsc"])
    ]
    assert [p.id for p in RUNTIME_PARAMS] == RUNTIMES


async def test_a_hang_report_names_the_await_each_task_is_stuck_in(capsys):
    """What tests/hang_report.py prints before pytest-timeout fails a hung async test: each task
    down to the innermost await (a task's own stack stops at its outermost coroutine)."""
    from .hang_report import print_tasks

    async def stuck() -> None:
        await asyncio.Event().wait()

    async def outer() -> None:
        await stuck()

    task = asyncio.create_task(outer(), name="the-stuck-one")
    await asyncio.sleep(0)
    try:
        print_tasks()
        report = capsys.readouterr().err
    finally:
        task.cancel()
    lines = report[report.index("-- task the-stuck-one:") :].splitlines()
    assert "in outer" in lines[1] and "in stuck" in lines[2] and "in wait" in lines[3], report
