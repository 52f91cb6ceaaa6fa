"""Sandbox uids: outside the host's subordinate id ranges, and unique on the host (across
threads, processes and gateway restarts), with Docker's labels as the source of truth."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.model.profiles import resolve_profile
from sandkernel.kernels.sandbox.container import SANDBOX_GID
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label
from sandkernel.kernels.sandbox.uids import SANDBOX_UID_RANGE, UID_LABEL, UidAllocator, subid_ranges

from ..conftest import RUNTIME_PARAMS, require_runtime

pytestmark = pytest.mark.security


def test_range_is_outside_default_subordinate_ids_and_below_2_31():
    low, high = SANDBOX_UID_RANGE
    assert low > 600_100_000 + 65536 and high <= 2**31 - 1  # useradd's SUB_UID_MAX default; signed 32 bits
    assert low > 0x6FFFFFFF  # systemd's container uid ranges end there


@pytest.mark.docker
def test_allocation_skips_subid_ranges_and_uids_in_use(tmp_path):
    """A 20-uid range: 10 covered by a subuid file, 1 by a subgid file, 3 reserved by live
    owners, 1 on a real container's label; the 5 left (one a dead owner's reservation) are
    handed out once each, then none."""
    low = SANDBOX_UID_RANGE[0] + 1000
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text(f"alice:{low}:10\nbroken line\n")
    subgid.write_text(f"bob:{low + 10}:1\n")
    assert subid_ranges([subuid, subgid]) == [(low, low + 10), (low + 10, low + 11)]
    directory = tmp_path / "uids"
    directory.mkdir()
    for uid in (low + 11, low + 12):
        (directory / str(uid)).write_text(owner_label())
    (directory / str(low + 13)).write_text("elsewhere:1:0")  # another host: counts as alive
    (directory / str(low + 14)).write_text(f"{owner_label().rsplit(':', 2)[0]}:999999999:1")  # dead owner
    engine = default_engine()
    labelled = low + 15
    container = engine.client.containers.create(
        resolve_profile().image,
        labels={UID_LABEL: str(labelled), "sandkernel.test": "uids", OWNER_LABEL: owner_label()},
    )
    try:
        allocator = UidAllocator(engine, directory, [subuid, subgid], (low, low + 20))
        got = [allocator.allocate() for _ in range(5)]
        assert sorted(got) == [low + 14, low + 16, low + 17, low + 18, low + 19], got
        with pytest.raises(Exception, match="no free sandbox uid"):
            allocator.allocate()
        allocator.release(got[0])
        assert allocator.allocate() == got[0]
    finally:
        container.remove(force=True)


ALLOCATE_IN_A_PROCESS = """
import json, sys
from pathlib import Path
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.uids import SANDBOX_UID_RANGE, UidAllocator
low = SANDBOX_UID_RANGE[0] + 5000
allocator = UidAllocator(default_engine(), Path(sys.argv[1]), [], (low, low + 40))
print(json.dumps([allocator.allocate() for _ in range(10)]), flush=True)
sys.stdin.read()  # stay alive (a dead owner's reservations are free again) until the test is done
"""


@pytest.mark.docker
def test_concurrent_processes_never_share_a_uid(tmp_path):
    """Four processes draw 10 uids each from a 40-uid range at once: all 40 distinct."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ALLOCATE_IN_A_PROCESS, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    uids = []
    try:
        for proc in procs:
            uids += json.loads(proc.stdout.readline())
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)
    assert len(uids) == 40 and len(set(uids)) == 40


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_sessions_started_together_have_distinct_uids(runtime):
    require_runtime(runtime)
    sessions = await asyncio.gather(
        *(KernelSession.start(overrides={"runtime": runtime, "memory_mb": 256}) for _ in range(4))
    )
    try:
        engine = default_engine()
        seen = {}
        for s in sessions:
            [c] = engine.client.containers.list(filters={"label": f"sandkernel.session={s.id}"})
            uid, gid = (int(x) for x in c.attrs["Config"]["User"].split(":"))
            assert gid == SANDBOX_GID and c.labels[UID_LABEL] == str(uid)
            assert SANDBOX_UID_RANGE[0] <= uid < SANDBOX_UID_RANGE[1]
            seen[s.id] = uid
        assert len(set(seen.values())) == len(sessions), seen
        # A restart keeps the container and its uid.
        await sessions[0].restart()
        [c] = engine.client.containers.list(filters={"label": f"sandkernel.session={sessions[0].id}"})
        assert c.labels[UID_LABEL] == str(seen[sessions[0].id])
        result = await sessions[0].execute("import os; print(os.getuid())", timeout=30)
        assert result.text == f"{seen[sessions[0].id]}\n"
    finally:
        await asyncio.gather(*(s.shutdown() for s in sessions))
