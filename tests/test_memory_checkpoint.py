"""Savable gVisor sandboxes (issue 33, steps 2 and 3): save a live kernel's memory and carry on
in a new container, with no cell run again.

Real parts only: the kernel provisioner under jupyter_client's AsyncKernelManager, gVisor's
runsc checkpoint, Docker's start from a checkpoint, ZMQ clients. Under runsc only: runc has no
memory checkpoint here (criu does not start on this kernel), and a savable runc sandbox is
refused with a clear error (the pure test below).
"""

from __future__ import annotations

import glob
import logging
import secrets
import shutil
from pathlib import Path

import pytest

from sandkernel.errors import ConfigError
from sandkernel.gateway.server import memory_snapshots_used
from sandkernel.kernels.execution.transport import new_kernel_manager
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.doctor import memory_snapshot_check, memory_snapshots_unavailable
from sandkernel.kernels.sandbox.memory_checkpoint import RESTORE_DIR

from .conftest import RUNSC, UNREACHABLE_DOCKER_HOST, require_runtime
from .gateway_fixtures import start_gateway, stop_gateway

SAVABLE_KERNEL = "sandkernel-python-gvisor"
# Where Docker's own start from a checkpoint had containerd unpack the image, and leave it.
CONTAINERD_UNPACKED = "/tmp/ctrd-checkpoint*"
# Seen by a restored sandbox just as by a fresh one (issue 33: "passes the same hardening
# checks"): the kernel's own seccomp filter, no capability, its uid, no network but loopback.
HARDENING = (
    "import os, socket\n"
    "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
    "print(*(status.get(k, '?').strip() for k in ('Seccomp', 'CapEff', 'CapBnd')), os.getuid() > 0,"
    " ','.join(sorted(name for _, name in socket.if_nameindex())))\n"
)


async def execute(km, code: str, *, timeout: float = 60) -> tuple[dict, str]:
    """Run ``code`` with a fresh client of ``km``: (the reply's content, the stream text)."""
    client = km.client()
    client.start_channels()
    out: list[str] = []
    try:
        await client.wait_for_ready(timeout=timeout)
        reply = await client.execute_interactive(
            code,
            timeout=timeout,
            output_hook=lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None,
        )
        return reply["content"], "".join(out)
    finally:
        client.stop_channels()


def test_only_gvisor_sandboxes_are_savable_and_doctor_says_why():
    """Pure: the doctor's verdict on this machine's parts, and runc's refusal (see below)."""
    assert memory_snapshot_check("runsc version 0.0~20240729.0", True).ok
    old = memory_snapshot_check("runsc version 0.0~20221219.0", True)
    assert not old.ok and "20240729" in old.detail and "bookworm-backports" in old.fix
    assert "wrapper" in memory_snapshot_check("runsc version 0.0~20240729.0", False).detail
    assert not memory_snapshot_check(None, True).ok


class _EngineRunning:
    """Docker's runtime table only, naming ``runsc`` as ``path`` (the one fault a test cannot cause
    for real: CI's Docker runs the wrapper, and changing its daemon.json would touch every test)."""

    def __init__(self, path: str) -> None:
        self.client = self
        self._runtimes = {"runc": {"path": "runc"}, "runsc": {"path": path}}

    def info(self) -> dict:
        return {"Runtimes": self._runtimes}


@pytest.mark.docker  # the second half reads this host's Docker
@pytest.mark.skipif(shutil.which("runsc") is None, reason="needs runsc installed")
def test_runsc_run_without_the_wrapper_is_reported_unavailable_with_its_fix():
    """What the gateway's start-up check reads (gateway/server.py turns memory snapshots off on
    it): Docker running runsc itself, not the wrapper, could not start a sandbox from its image."""
    why = memory_snapshots_unavailable(_EngineRunning(shutil.which("runsc")))
    assert why is not None and "wrapper" in why and "host-setup.sh" in why
    installed = default_engine().client.info()["Runtimes"].get("runsc", {}).get("path")
    if installed and "sandkernel" in installed:  # this host's own Docker runs the wrapper
        assert memory_snapshots_unavailable() is None


async def test_auto_memory_snapshots_are_off_where_docker_cannot_say_and_an_asked_on_warns(monkeypatch, caplog):
    """--memory-snapshots auto (the default) on a host whose Docker cannot be asked: off, said at
    INFO (no warning on a host that simply lacks them); an explicit on there is a warning; off
    never asks. The engine is a real one aimed at a socket that cannot exist."""
    monkeypatch.setenv("DOCKER_HOST", UNREACHABLE_DOCKER_HOST)
    caplog.set_level(logging.INFO, logger="sandkernel.gateway.server")
    assert await memory_snapshots_used("auto", DockerEngine()) == "off"
    [said] = [r for r in caplog.records if r.name == "sandkernel.gateway.server"]
    assert said.levelno == logging.INFO and "could not be read" in said.getMessage(), said.getMessage()
    caplog.clear()
    assert await memory_snapshots_used("on", DockerEngine()) == "off"
    [said] = [r for r in caplog.records if r.name == "sandkernel.gateway.server"]
    assert said.levelno == logging.WARNING and "replay cells instead" in said.getMessage(), said.getMessage()
    caplog.clear()
    assert await memory_snapshots_used("off", DockerEngine()) == "off"
    assert not [r for r in caplog.records if r.name == "sandkernel.gateway.server"]


@pytest.mark.docker
async def test_a_default_gateway_keeps_gvisor_memory_exactly_where_the_host_can(tmp_path):
    """The default (auto) comes to on or off at start, as the host's check says, never auto."""
    expected = "on" if memory_snapshots_unavailable() is None else "off"
    gw = await start_gateway(tmp_path)
    try:
        assert gw.settings.memory_snapshots == expected
    finally:
        await stop_gateway(gw)


@pytest.mark.docker
async def test_a_runc_sandbox_cannot_be_savable():
    km = new_kernel_manager("sandkernel-python")
    with pytest.raises(ConfigError, match="need gVisor"):
        await km.start_kernel(sandkernel_savable=True, sandkernel_session_id=secrets.token_hex(8))
    assert km.provisioner is None or km.provisioner.container is None


@pytest.mark.parametrize("runtime", [RUNSC])
async def test_a_saved_kernel_carries_on_in_a_new_container_with_a_fresh_key(runtime, tmp_path: Path):
    """Save a kernel holding random data and a seeded generator mid-stream; remove its container;
    start a new one from the image: the same data, the generator's next draw, the execution
    count going on (no cell ran again), the same hardening, a new key that the old one cannot
    stand in for, and a restart that still gives a fresh kernel."""
    require_runtime(runtime)
    session_id = secrets.token_hex(8)
    image = tmp_path / "memory"
    parent = new_kernel_manager(SAVABLE_KERNEL)
    child = None
    try:
        await parent.start_kernel(sandkernel_savable=True, sandkernel_session_id=session_id)
        setup = (
            "import hashlib, os, random\n"
            "blob = os.urandom(20 * 2**20); digest = hashlib.sha256(blob).hexdigest()\n"
            "rng = random.Random(7); rng.random()\n"
            "print(digest)"
        )
        reply, _ = await execute(parent, setup)
        assert reply["status"] == "ok" and reply["execution_count"] == 1, reply
        _, fresh_hardening = await execute(parent, HARDENING)
        old_key = parent.session.key
        container_id = parent.provisioner.container.id

        await parent.provisioner.save_memory(image)
        assert sorted(p.name for p in image.iterdir()) == ["checkpoint.img", "pages.img", "pages_meta.img"]
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in image.iterdir())
        workspace = parent.provisioner.hand_over_workspace()
        await parent.shutdown_kernel(now=True)
        assert not default_engine().client.containers.list(all=True, filters={"id": container_id})

        unpacked_before = set(glob.glob(CONTAINERD_UNPACKED))
        child = new_kernel_manager(SAVABLE_KERNEL)
        await child.start_kernel(
            sandkernel_restore_from=str(image), sandkernel_session_id=session_id, sandkernel_workspace=workspace
        )
        assert child.provisioner.container.id != container_id
        # Restored in place by Docker's runsc (the wrapper): no copy of the tenant's memory left
        # by containerd, nothing left in the hand-over directory.
        assert set(glob.glob(CONTAINERD_UNPACKED)) == unpacked_before
        assert not [p for p in RESTORE_DIR.iterdir() if p.name.startswith(child.provisioner.container.id)]
        assert child.session.key != old_key

        # The parent's key opens nothing: a cell signed with it, sent first on the same socket,
        # is dropped; the next one, with the child's key, runs and finds no trace of it.
        client = child.client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=60)
            new_key = client.session.key
            client.session.key = old_key
            client.execute("planted = 1", silent=True)
            client.session.key = new_key
            reply = await client.execute_interactive("x = 1", timeout=60)
        finally:
            client.stop_channels()
        assert reply["content"]["status"] == "ok"
        assert reply["content"]["execution_count"] == 3, "a cell ran again, or the dropped one ran"

        check = "print('planted' in dir(), digest == hashlib.sha256(blob).hexdigest(), rng.random())"
        reply, text = await execute(child, check)
        planted, same_blob, draw = text.split()
        assert (planted, same_blob) == ("False", "True")
        assert float(draw) == random_draws(seed=7, skip=1), "the generator did not carry on where it was"
        assert reply["execution_count"] == 4
        _, restored_hardening = await execute(child, HARDENING)
        assert restored_hardening == fresh_hardening
        assert fresh_hardening.split() == ["2", "0000000000000000", "0000000000000000", "True", "lo"], fresh_hardening

        await child.restart_kernel(now=True)  # a restart in a savable sandbox: a fresh kernel
        reply, text = await execute(child, "print('blob' in dir())")
        assert (reply["execution_count"], text.strip()) == (1, "False")
    finally:
        for km in (parent, child):
            if km is not None and km.has_kernel:
                await km.shutdown_kernel(now=True)
        shutil.rmtree(image, ignore_errors=True)


def random_draws(seed: int, skip: int) -> float:
    """The draw after ``skip`` draws of ``random.Random(seed)``."""
    import random

    rng = random.Random(seed)
    for _ in range(skip):
        rng.random()
    return rng.random()
