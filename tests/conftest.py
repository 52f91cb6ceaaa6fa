"""Shared fixtures and the suite's two tiers.

Tiers. Pure-logic tests run anywhere in seconds (``pytest -m "not docker"``: no engine, no
image); container tests need a real Docker engine and the real kernel image, as the README's test
command sets up. Which tier a test is in is decided here, in one place
(:func:`pytest_collection_modifyitems`), not in each file: a test is ``docker`` when it uses a
fixture of :data:`DOCKER_FIXTURES`, is parametrised over :data:`RUNTIMES`, or is listed in
:data:`DOCKER_TESTS`; ``runsc`` when one of its parameters is runsc; ``security`` under
tests/security. When the selection holds no docker test, the session checks are skipped and the
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
from sandkernel.kernels.lifecycle.profiles import resolve_profile
from sandkernel.kernels.lifecycle.reaper import OWNER_LABEL, listed_containers, owner_label, reap_sync
from sandkernel.kernels.sandbox.docker_engine import default_engine

# The throwaway PostgreSQL server's fixtures (postgres_server, postgres_url, fresh_postgres_url),
# for every module: made only when a test asks for one.
from .postgres_fixtures import fresh_postgres_url, postgres_server, postgres_url  # noqa: F401

REQUIRE_RUNSC_ENV = "SANDKERNEL_REQUIRE_RUNSC"
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

# Fixtures that start a kernel container, or a gateway that starts them (and checks the engine).
DOCKER_FIXTURES = frozenset(
    {"session", "arena", "gateway", "client", "stack", "egress_gateway", "fast_ladder", "inspected",
     "kernelspec_prefix", "nothing_left"}
)
# Tests that reach the engine without such a fixture: a whole module ("*") or the named tests
# (original names, before parametrisation). A pure test wrongly left out fails the pure tier.
DOCKER_TESTS: dict[str, str | frozenset[str]] = {
    "tests/test_bad_input.py": "*",
    "tests/test_gateway_lifecycle.py": "*",
    "tests/test_snapshots.py": "*",
    "tests/test_client_snapshots.py": frozenset(
        {"test_pause_then_execute_resumes_with_variables_and_files", "test_fork_copies_the_state_and_the_forks_diverge",
         "test_rewind_forgets_what_later_cells_made", "test_a_pause_while_code_runs_is_refused_as_busy",
         "test_the_sync_client_forks_into_sync_sessions"}
    ),
    "tests/test_jupyter_server_gateway.py": "*",
    "tests/test_jupyter_tools.py": "*",
    "tests/test_lifecycle.py": "*",
    "tests/test_pool.py": "*",
    "tests/test_egress.py": frozenset({"test_a_gateway_without_an_egress_policy_grants_no_network"}),
    # Many hosts (issue 18): a real PostgreSQL (installed by the host set-up), gateways, engines.
    "tests/test_cluster_catalog.py": "*",
    "tests/test_cluster_membership.py": "*",
    "tests/test_cluster_catalog_outage.py": "*",
    "tests/test_cluster_direct_to_owner.py": "*",
    "tests/test_cluster_kernelspecs.py": "*",
    "tests/test_cluster_launcher.py": "*",
    "tests/test_gateway_tls.py": frozenset({"test_gateways_serve_https_and_wss_and_forward_to_each_other_over_tls"}),
    "tests/test_cluster_paused_elsewhere.py": frozenset(
        {"test_only_a_host_sharing_the_down_hosts_snapshot_store_takes_its_paused_session_and_only_once",
         "test_a_session_paused_on_a_host_that_died_resumes_on_a_host_sharing_the_snapshot_dir"}
    ),
    "tests/test_forwarding.py": "*",
    "tests/test_cluster_kernels_api.py": frozenset(
        {"test_a_kernel_created_through_a_lands_on_the_host_with_more_room_and_is_listed_by_both",
         "test_code_runs_through_a_websocket_on_the_gateway_that_does_not_hold_the_kernel",
         "test_busy_shows_cluster_wide_and_interrupt_and_restart_through_a_reach_the_kernel",
         "test_another_tenant_sees_none_of_it_anywhere", "test_a_kernel_is_deleted_through_the_gateway_that_does_not_hold_it",
         "test_kernel_creates_count_against_the_tenants_limit_across_the_cluster",
         "test_bad_kernel_requests_are_400_saying_what_to_send",
         "test_jupyter_server_pointed_at_one_gateway_uses_a_kernel_placed_on_the_other",
         "test_a_full_cluster_and_a_lost_catalog_refuse_kernels_and_the_held_one_keeps_working"}
    ),
    "tests/test_cluster_lab.py": "*",
    "tests/test_cluster_swarm.py": "*",
    "tests/test_cluster_deploy.py": frozenset({"test_cluster_up_on_an_engine_that_is_not_a_swarm_manager_says_what_to_do"}),
    "tests/test_gateway_image.py": frozenset(
        {"test_the_image_runs_this_checkouts_sandkernel_with_the_disk_tools",
         "test_doctor_in_the_image_makes_and_mounts_a_disk_workspace"}
    ),
    "tests/test_cli.py": frozenset(
        {"test_doctor_reports_a_ready_machine", "test_run_prints_the_result_and_json",
         "test_bad_input_gets_a_one_line_error_not_a_traceback",
         "test_demo_runs_the_sales_agent_offline_and_leaves_a_valid_notebook",
         "test_agent_cli_end_to_end_against_the_scripted_api"}
    ),
    "tests/test_notebooks.py": frozenset(
        {"test_sigkill_of_the_gateway_leaves_a_valid_notebook", "test_examples_replay_the_same",
         "test_a_changed_cell_is_reported_with_a_diff", "test_replay_restores_uploads_and_asks_for_files_too_large_to_embed"}
    ),
    "tests/test_replay.py": frozenset(
        {"test_public_notebook_with_odd_metadata_replays_to_a_valid_notebook",
         "test_an_output_the_schema_rejects_does_not_stop_the_replay",
         "test_a_cell_that_kills_its_kernel_is_judged_and_the_rest_continue",
         "test_an_endless_cell_times_out_and_the_replay_goes_on", "test_a_recorded_death_replayed_is_not_a_difference",
         "test_widget_notebook_replays_the_same", "test_nbformat_3_notebook_is_converted_and_replayed",
         "test_until_leaves_later_cells_not_run", "test_a_cell_refused_when_recorded_is_not_run"}
    ),
    "tests/test_mcp_http.py": frozenset({"test_the_gateway_serves_without_the_mcp_extra"}),
    "tests/test_controls_gateway.py": frozenset({"test_the_operator_can_turn_accounting_off"}),
    "tests/security/test_reaper.py": "*",
    "tests/security/test_sandbox_uids.py": frozenset(
        {"test_allocation_skips_subid_ranges_and_uids_in_use", "test_concurrent_processes_never_share_a_uid"}
    ),
    "tests/security/test_settings.py": "*",
}
# The engine address used when a run selects no docker test: a socket that cannot exist.
UNREACHABLE_DOCKER_HOST = "unix:///nonexistent/sandkernel-pure-tier/docker.sock"


def is_docker_test(item: pytest.Item) -> bool:
    """The tier rule (see the module docstring); pure, so a planted case can be checked."""
    if DOCKER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(v in RUNTIMES for v in callspec.params.values() if isinstance(v, str)):
        return True
    listed = DOCKER_TESTS.get(Path(str(item.path)).relative_to(ROOT).as_posix())
    return listed == "*" or (listed is not None and getattr(item, "originalname", item.name) in listed)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every collected test with its tier (and runsc, security) before ``-m`` selects."""
    for item in items:
        if is_docker_test(item):
            item.add_marker(pytest.mark.docker)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "runsc" in callspec.params.values():
            item.add_marker(pytest.mark.runsc)
        if SECURITY_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.security)


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
        c.id
        # sparse: one listing, no inspect per container (one removed meanwhile would raise NotFound)
        for c in engine.client.containers.list(
            all=True, sparse=True, filters={"label": f"sandkernel.session={session_id}"}
        )
    ]
