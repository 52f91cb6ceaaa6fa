"""Shared fixtures: a real Docker engine, the real kernel image, sessions under each runtime.

Nothing here is mocked. The suite needs the engine running and the image built (the README's
test command does both). runsc is exercised wherever gVisor is installed: installed but not
registered with Docker is a failure, not a skip, and with ``SANDKERNEL_REQUIRE_RUNSC=1`` (CI sets
it on machines that have gVisor, see .ci/run) not installed is a failure too, so CI cannot
silently drop the gVisor half.
At the end, any container this test process created and left behind is removed AND reported
as an error, so a leaking test fails the run.
"""

from __future__ import annotations

import enum
import os
import shutil

import pytest

from sandkernel.errors import SandkernelError
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.profiles import resolve_profile
from sandkernel.kernels.lifecycle.reaper import OWNER_LABEL, owner_label, reap_sync
from sandkernel.kernels.sandbox.docker_engine import default_engine

REQUIRE_RUNSC_ENV = "SANDKERNEL_REQUIRE_RUNSC"


class RunscState(enum.Enum):
    REGISTERED = "registered"
    NOT_REGISTERED = "installed but not registered with Docker"
    NOT_INSTALLED = "not installed"


class Verdict(enum.Enum):
    RUN = "run"
    SKIP = "skip"
    FAIL = "fail"


def runsc_state() -> RunscState:
    """What this machine offers: asks the engine, then looks for the binary."""
    if "runsc" in default_engine().runtimes_sync():
        return RunscState.REGISTERED
    return RunscState.NOT_REGISTERED if shutil.which("runsc") else RunscState.NOT_INSTALLED


def runsc_required() -> bool:
    """``SANDKERNEL_REQUIRE_RUNSC``, read at call time: 1 requires gVisor, 0 or unset does not.
    Any other value is refused rather than guessed, so a typo cannot turn the guard off."""
    value = os.environ.get(REQUIRE_RUNSC_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{REQUIRE_RUNSC_ENV} must be 1 or 0, not {value!r}")
    return value == "1"


def runsc_verdict(state: RunscState, required: bool) -> tuple[Verdict, str]:
    """Whether a runsc test runs, skips or fails here, and why (pure: unit-tested in
    tests/test_suite_guards.py). Registered always runs; installed but unregistered always
    fails (a broken set-up, never a reason to drop gVisor); absent skips only when gVisor is
    not required."""
    if state is RunscState.REGISTERED:
        return Verdict.RUN, "runsc is registered"
    if state is RunscState.NOT_REGISTERED:
        return Verdict.FAIL, "runsc is installed but not registered with Docker: run scripts/host-setup.sh"
    if required:
        return Verdict.FAIL, (
            f"gVisor (runsc) is not installed but {REQUIRE_RUNSC_ENV}=1 requires it: "
            "run scripts/host-setup.sh as root and read why the runsc install failed"
        )
    return Verdict.SKIP, f"gVisor (runsc) is not installed on this machine ({REQUIRE_RUNSC_ENV} is not 1)"


def skip_forbidden(nodeid: str, required: bool) -> bool:
    """A skipped test whose id names runsc, while gVisor is required: whatever skipped it (our
    guard, a helper's ``skipif``, a fixture), the run must not pass without it."""
    return required and "runsc" in nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Turn every runsc skip into a failure when ``SANDKERNEL_REQUIRE_RUNSC=1``."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and skip_forbidden(item.nodeid, runsc_required()):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under {REQUIRE_RUNSC_ENV}=1, which forbids skipping runsc tests: {reason}"


RUNTIMES = ["runc", "runsc"]


@pytest.fixture(scope="session", autouse=True)
def docker_ready():
    """Fail fast, with the fix, when the engine or the image is missing; reap our leftovers."""
    engine = default_engine()
    try:
        engine.image_id_sync(resolve_profile().image)
    except SandkernelError as err:
        pytest.exit(f"cannot run the suite: {err}", returncode=2)
    yield engine
    leftovers = engine.client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"})
    names = [c.name for c in leftovers]
    reap_sync(engine, owner=owner_label())
    if names:
        pytest.fail(f"the test suite left {len(names)} container(s) behind: {names}")


def require_runtime(runtime: str) -> None:
    """Every runsc test and fixture calls this first: see :func:`runsc_verdict`."""
    if runtime != "runsc":
        return
    verdict, reason = runsc_verdict(runsc_state(), runsc_required())
    if verdict is Verdict.SKIP:
        pytest.skip(reason)
    if verdict is Verdict.FAIL:
        pytest.fail(reason)


@pytest.fixture(scope="module", params=RUNTIMES)
async def session(request):
    """A shared session per runtime for tests that only read or probe."""
    require_runtime(request.param)
    s = await KernelSession.start(overrides={"runtime": request.param, "pids": 128, "cpus": 0.5, "memory_mb": 512})
    yield s
    await s.shutdown()


def container_ids_of(session_id: str) -> list[str]:
    engine = default_engine()
    return [
        c.id for c in engine.client.containers.list(all=True, filters={"label": f"sandkernel.session={session_id}"})
    ]
