"""Shared fixtures and the suite's two tiers.

Tiers. Pure-logic tests run anywhere in seconds (``pytest -m "not docker"``: no engine, no
image); container tests need a real Docker engine and the real kernel image, as the README's test
command sets up. Each test says its tier itself: ``pytestmark = pytest.mark.docker`` on a module
whose tests all need Docker, ``@pytest.mark.docker`` on a test of a mixed module, and the runtime
parameters of :data:`RUNTIME_PARAMS` (docker, and runsc for runsc) wherever a test or fixture is
parametrised over the runtimes; every module of tests/security carries ``pytest.mark.security``.
Nothing is inferred: the collection hook only checks (:func:`missing_marks`) that a test using a
fixture that starts containers (:data:`CONTAINER_FIXTURES`), parametrised over a runtime, or
under tests/security carries its marks, and refuses to run otherwise, so a forgotten mark fails
every run instead of quietly moving a container test into the pure tier.
When the selection holds no docker test, the session checks are skipped and the
engine is made unreachable (:data:`UNREACHABLE_DOCKER_HOST`) for the run, so a pure test that
touches Docker fails on every machine instead of passing where an engine happens to run.

Nothing here is mocked. runsc is exercised wherever gVisor is installed: installed but not
registered with Docker is a failure, not a skip, and with ``SANDKERNEL_REQUIRE_RUNSC=1`` (CI sets
it on machines that have gVisor, see .ci/run) not installed is a failure too, so CI cannot
silently drop the gVisor half.
At the end of a run with docker tests, any container this test process created and left behind
is removed AND reported as an error, so a leaking test fails the run.
"""

from __future__ import annotations

import enum
import os
import shutil
from pathlib import Path

import pytest

from sandkernel.errors import SandkernelError
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.lifecycle.reaper import listed_containers, reap_sync
from sandkernel.kernels.model.profiles import resolve_profile
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label

# Parallel runs (pytest-xdist): the groups, their order and the exclusive tests' lock, see
# tests/scheduling.py; what each tier cost, printed at the end of a run: tests/tier_times.py;
# where the CPU went, when asked for: tests/cpu_trace.py.
from . import cpu_trace, scheduling

# A hung async test's tasks, printed before pytest-timeout fails it: tests/hang_report.py.
from .hang_report import pytest_runtest_call  # noqa: F401

# The throwaway PostgreSQL server's fixtures (postgres_server, postgres_url, fresh_postgres_url),
# for every module: made only when a test asks for one.
from .postgres_fixtures import fresh_postgres_url, postgres_server, postgres_url  # noqa: F401
from .scheduling import (  # noqa: F401
    assign_groups,
    name_groups_in_node_ids,
    pytest_runtest_protocol,
)
from .tier_times import pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401

REQUIRE_RUNSC_ENV = "SANDKERNEL_REQUIRE_RUNSC"


def pytest_configure(config: pytest.Config) -> None:
    """The parallel queue's order (tests/scheduling.py), and the CPU trace when asked for
    (``SANDKERNEL_CPU_TRACE=DIR``: which tests the CPU went to, tests/cpu_trace.py)."""
    scheduling.pytest_configure(config)
    if os.environ.get(cpu_trace.ENV):
        config.pluginmanager.register(cpu_trace, "sandkernel-cpu-trace")


ROOT = Path(__file__).resolve().parents[1]
SECURITY_DIR = ROOT / "tests" / "security"


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
# The runtimes as parameters carrying their tiers' marks: what container tests are parametrised
# over, ``@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)`` or ``@pytest.fixture(params=RUNTIME_PARAMS)``
# (a fixture's marks reach every test using it). The ids keep the node ids ``...[runc]``, ``...[runsc]``.
RUNC = pytest.param("runc", marks=pytest.mark.docker, id="runc")
RUNSC = pytest.param("runsc", marks=[pytest.mark.docker, pytest.mark.runsc], id="runsc")
RUNTIME_PARAMS = [RUNC, RUNSC]
# A door's own code (the websocket's execute, MCP over HTTP and its tools, the Python client riding
# through a gateway restart, the deepagents backend, policy checked at each door) runs in the
# gateway, the same whatever runtime holds the kernel behind it: those modules run under runc, and
# each door's smoke test under both runtimes too. What a runtime changes (the boundary, resources,
# deaths and OOMs, accounting, adoption after a restart, snapshots, the kernel image) is tested
# under both wherever it is tested (tests/README.md, "What runs under which runtime").
DOOR_RUNTIME_PARAMS = [RUNC]

# Fixtures that start containers (a kernel, a gateway that starts them, the Swarm lab) or reach
# the engine: a test using one, directly or through another fixture, must carry the docker mark.
CONTAINER_FIXTURES = frozenset(
    {
        "kernel_session",
        "arena",
        "gateway",
        "gw",
        "client",
        "stack",
        "egress_gateway",
        "mcp_stack",
        "agent_gateway",
        "swarm_lab",
        "fast_ladder",
        "inspected",
        "kernelspec_prefix",
        "nothing_left",
    }
)
# The engine address used when a run selects no docker test: a socket that cannot exist.
UNREACHABLE_DOCKER_HOST = "unix:///nonexistent/sandkernel-pure-tier/docker.sock"


def missing_marks(item: pytest.Item) -> list[str]:
    """The marks ``item`` should carry and does not (see the module docstring): docker when it
    uses a fixture of :data:`CONTAINER_FIXTURES` or has a runtime parameter, runsc when that
    parameter is runsc, security under tests/security. Pure, so a planted item can be checked."""
    callspec = getattr(item, "callspec", None)
    params = [v for v in callspec.params.values() if isinstance(v, str)] if callspec is not None else []
    needed = set()
    if CONTAINER_FIXTURES & set(getattr(item, "fixturenames", ())) or any(v in RUNTIMES for v in params):
        needed.add("docker")
    if "runsc" in params:
        needed.add("runsc")
    if SECURITY_DIR in Path(str(item.path)).parents:
        needed.add("security")
    return sorted(needed - {mark.name for mark in item.iter_markers()})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse to run when a test lacks a mark its fixtures, parameters or folder call for: a
    forgotten docker mark would otherwise move a container test into the pure tier, where it fails
    (or, with runsc, out of ``-m runsc``). Runs before ``-m`` deselects, so every tier's run checks
    every test. Then groups the tests for parallel runs (tests/scheduling.py)."""
    unmarked = [f"{item.nodeid}: add {', '.join(missing)}" for item in items if (missing := missing_marks(item))]
    if unmarked:
        listed = "\n  ".join(unmarked)
        raise pytest.UsageError(f"{len(unmarked)} test(s) lack marks they need (tests/conftest.py):\n  {listed}")
    assign_groups(items, module_of, runtime_of, lambda item: item.get_closest_marker("docker") is not None)
    name_groups_in_node_ids(config, items)


def module_of(item: pytest.Item) -> str:
    """The test's module, relative to the repository (``tests/test_x.py``)."""
    return Path(str(item.path)).relative_to(ROOT).as_posix()


def runtime_of(item: pytest.Item) -> str | None:
    """The runtime a test is parametrised over, if any."""
    callspec = getattr(item, "callspec", None)
    values = (
        [part for v in callspec.params.values() for part in (v if isinstance(v, tuple) else (v,))] if callspec else []
    )
    found = [v for v in values if isinstance(v, str) and v in RUNTIMES]
    return found[0] if found else None


@pytest.fixture(scope="session", autouse=True)
def docker_ready(request):
    """With docker tests selected: fail fast, with the fix, when the engine or the image is
    missing, and reap our leftovers at the end. Without: make the engine unreachable, so the
    pure tier proves on every machine that it needs none."""
    if not any(item.get_closest_marker("docker") for item in request.session.items):
        saved = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = UNREACHABLE_DOCKER_HOST
        yield None
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
        return
    engine = default_engine()
    try:
        engine.image_id_sync(resolve_profile().image)
    except SandkernelError as err:
        pytest.exit(f"cannot run the suite: {err}", returncode=2)
    yield engine
    names = [c.name for c in listed_containers(engine) if c.labels.get(OWNER_LABEL) == owner_label()]
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


@pytest.fixture(scope="module", params=RUNTIME_PARAMS)
async def kernel_session(request):
    """A shared KernelSession (no gateway) per runtime, for tests that only read or probe."""
    require_runtime(request.param)
    s = await KernelSession.start(overrides={"runtime": request.param, "pids": 128, "cpus": 0.5, "memory_mb": 512})
    yield s
    await s.shutdown()


def container_ids_of(session_id: str) -> list[str]:
    engine = default_engine()
    return [
        c.id
        # sparse: one listing, no inspect per container (one removed meanwhile would raise NotFound)
        for c in engine.client.containers.list(
            all=True, sparse=True, filters={"label": f"sandkernel.session={session_id}"}
        )
    ]
