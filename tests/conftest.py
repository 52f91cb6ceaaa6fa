"""Shared fixtures: a real Docker engine, the real kernel image, sessions under each runtime.

Nothing here is mocked. The suite needs the engine running and the image built (the README's
test command does both). runsc is exercised wherever gVisor is installed: installed but not
registered with Docker is a failure, not a skip, so CI cannot silently drop the gVisor half.
At the end, any container this test process created and left behind is removed AND reported
as an error, so a leaking test fails the run.
"""

from __future__ import annotations

import shutil

import pytest

from sandkernel.errors import SandkernelError
from sandkernel.kernels.docker_engine import default_engine
from sandkernel.kernels.profiles import resolve_profile
from sandkernel.kernels.reaper import OWNER_LABEL, owner_label, reap_sync
from sandkernel.kernels.session import KernelSession


def _runsc_state() -> str:
    registered = "runsc" in default_engine().runtimes_sync()
    if registered:
        return "ok"
    return "missing-registration" if shutil.which("runsc") else "not-installed"


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
    """Skip runsc only where gVisor is not installed at all."""
    if runtime != "runsc":
        return
    state = _runsc_state()
    if state == "not-installed":
        pytest.skip("gVisor (runsc) is not installed on this machine")
    if state == "missing-registration":
        pytest.fail("runsc is installed but not registered with Docker: run scripts/host-setup.sh")


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
