"""Bad input to public functions: a clear error naming the fix, and no container left behind."""

from __future__ import annotations

import pytest

from sandkernel.errors import (
    ArgumentTypeError,
    ConfigError,
    ImageNotFoundError,
    RuntimeUnavailableError,
    SessionClosedError,
    UnknownProfileError,
)
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label
from sandkernel.kernels.sandbox.runtime_dir import default_base_dir

pytestmark = pytest.mark.docker


def _our_containers() -> set[str]:
    return {
        c.id
        for c in default_engine().client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"})
    }


@pytest.fixture
def nothing_left(tmp_path, monkeypatch):
    """Assert a failing call created no container and no runtime dir. The runtime dirs' base is
    the test's own: other test processes on this machine make and remove theirs meanwhile."""
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("SANDKERNEL_RUNTIME_DIR", str(base))
    assert default_base_dir() == base
    containers = _our_containers()
    yield
    assert _our_containers() == containers
    # No runtime dir and no uid reservation (only the allocator's lock, if it got that far).
    assert [p for p in base.rglob("*") if p not in (base / "uids", base / "uids" / ".lock")] == []


@pytest.mark.parametrize(
    ("kwargs", "error", "fix"),
    [
        ({"profile": "gigantic"}, UnknownProfileError, "choose one of"),
        ({"overrides": {"memory_mb": 1}}, ConfigError, "out of range; use 64 to 65536"),
        ({"overrides": {"cpus": "two"}}, ConfigError, "cpus must be a number"),
        ({"overrides": {"image": "sandkernel-no-such-image:0"}}, ImageNotFoundError, "sandkernel image build"),
        ({"overrides": {"runtime": "firecracker"}}, ConfigError, "runtime must be one of"),
    ],
)
async def test_bad_session_arguments(nothing_left, kwargs, error, fix):
    with pytest.raises(error, match=fix):
        await KernelSession.start(**kwargs)


async def test_unregistered_runtime_fails_closed(nothing_left):
    with pytest.raises(RuntimeUnavailableError, match="does not fall back"):
        await default_engine().require_runtime("kata-runtime")
    if "runsc" not in default_engine().runtimes_sync():
        with pytest.raises(RuntimeUnavailableError, match="apt-get install runsc"):
            await KernelSession.start(overrides={"runtime": "runsc"})


async def test_bad_execute_arguments_leave_the_session_usable():
    async with await KernelSession.start() as s:
        with pytest.raises(ArgumentTypeError, match="code must be a string of Python source, not int"):
            await s.execute(42)
        with pytest.raises(ArgumentTypeError, match="not bytes"):
            await s.execute(b"print(1)")
        for timeout in (0, -1, "10", float("inf")):
            with pytest.raises(ConfigError, match="timeout must be a number of seconds"):
                await s.execute("1", timeout=timeout)
        assert (await s.execute("print('fine')", timeout=30)).text == "fine\n"
    with pytest.raises(SessionClosedError, match="start a new session"):
        await s.execute("1")
