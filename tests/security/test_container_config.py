"""Every session container, inspected: each hardened setting is one case, checked on the
attacker's and the canary's containers alike (docker inspect, not the request we sent)."""

from __future__ import annotations

import json

import pytest

from sandkernel.kernels.container import SANDBOX_GID, SANDBOX_UID_RANGE, host_pids_limit
from sandkernel.kernels.docker_engine import default_engine
from sandkernel.kernels.profiles import resolve_profile
from sandkernel.kernels.runtime_dir import CONTAINER_DIR

from .conftest import ATTACKER_LIMITS

pytestmark = pytest.mark.security


def uid_of(c):
    uid, gid = (int(x) for x in c["Config"]["User"].split(":"))
    return SANDBOX_UID_RANGE[0] <= uid < SANDBOX_UID_RANGE[1] and gid == SANDBOX_GID


CHECKS = {
    "unprivileged_own_uid": uid_of,
    "not_privileged": lambda c: c["HostConfig"]["Privileged"] is False,
    "read_only_root": lambda c: c["HostConfig"]["ReadonlyRootfs"] is True,
    "all_caps_dropped": lambda c: c["HostConfig"]["CapDrop"] == ["ALL"] and not c["HostConfig"]["CapAdd"],
    "no_new_privileges": lambda c: "no-new-privileges:true" in c["HostConfig"]["SecurityOpt"],
    "own_seccomp_profile": lambda c: any(
        o.startswith("seccomp=") and "unconfined" not in o and json.loads(o[8:])["syscalls"]
        for o in c["HostConfig"]["SecurityOpt"]
    ),
    "no_network": lambda c: c["HostConfig"]["NetworkMode"] == "none" and not c["NetworkSettings"]["Ports"],
    "private_ipc_pid_uts": lambda c: (
        c["HostConfig"]["IpcMode"] == "private"
        and c["HostConfig"]["PidMode"] == ""
        and c["HostConfig"]["UTSMode"] == ""
    ),
    "memory_no_swap": lambda c: 0 < c["HostConfig"]["Memory"] == c["HostConfig"]["MemorySwap"],
    "cpu_quota": lambda c: 0 < c["HostConfig"]["NanoCpus"] <= 4 * 10**9,
    "pids_limit": lambda c: 0 < c["HostConfig"]["PidsLimit"] <= 4096,
    "ulimits": lambda c: (
        {u["Name"] for u in c["HostConfig"]["Ulimits"]} == {"nofile", "core", "fsize"}
        and all(u["Soft"] == u["Hard"] for u in c["HostConfig"]["Ulimits"])
    ),
    "no_core_dumps": lambda c: any(u["Name"] == "core" and u["Hard"] == 0 for u in c["HostConfig"]["Ulimits"]),
    "only_the_runtime_dir_is_bound": lambda c: (
        [m["Destination"] for m in c["Mounts"] if m["Type"] == "bind"] == [CONTAINER_DIR]
    ),
    "capped_tmpfs": lambda c: all(
        "size=" in o and "nosuid" in o and "nodev" in o for o in c["HostConfig"]["Tmpfs"].values()
    ),
    "no_docker_socket": lambda c: (
        not any("docker.sock" in json.dumps(m) or "containerd" in json.dumps(m) for m in c["Mounts"])
    ),
    "no_devices": lambda c: not c["HostConfig"]["Devices"] and not c["HostConfig"].get("DeviceRequests"),
    "no_sysctls_or_extra_groups": lambda c: not c["HostConfig"].get("Sysctls") and not c["HostConfig"]["GroupAdd"],
    "init_is_catatonit": lambda c: "catatonit" in json.dumps(c["Config"]["Entrypoint"] or c["Config"]["Cmd"]),
    "log_capped": lambda c: c["HostConfig"]["LogConfig"]["Config"].get("max-size") == "1m",
    "labelled": lambda c: (
        {"sandkernel.session", "sandkernel.kernel", "sandkernel.owner", "sandkernel.uid"} <= set(c["Config"]["Labels"])
    ),
    "no_host_environment": lambda c: (
        not any(
            e.split("=", 1)[0] in {"SANDKERNEL_TOKEN", "ANTHROPIC_API_KEY", "DOCKER_HOST", "PYENV_ROOT"}
            for e in c["Config"]["Env"]
        )
    ),
}


def containers_of(arena):
    engine = default_engine()
    found = []
    for session in (arena.attacker, arena.canary):
        [container] = engine.client.containers.list(filters={"label": f"sandkernel.session={session['id']}"})
        found.append(engine.client.api.inspect_container(container.id))
    return found


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_hardened_setting(arena, check):
    for inspected in containers_of(arena):
        assert CHECKS[check](inspected), f"{check} fails on {inspected['Name']} ({arena.runtime})"
        assert inspected["HostConfig"]["Runtime"] == arena.runtime


async def test_limits_follow_the_profile_and_uids_differ(arena):
    attacker, canary = containers_of(arena)
    profile = resolve_profile(overrides={"runtime": arena.runtime, **ATTACKER_LIMITS})
    assert attacker["HostConfig"]["Memory"] == ATTACKER_LIMITS["memory_mb"] * 2**20
    assert attacker["HostConfig"]["PidsLimit"] == host_pids_limit(profile)
    assert attacker["Config"]["User"] != canary["Config"]["User"], "two sandboxes must not share a host uid"
