"""Every session container, inspected: each hardened setting is one case, checked on the
attacker's and the canary's containers alike (docker inspect, not the request we sent). Limits
are compared with exact values: the profile the gateway reports for each session, which for
the attacker is checked against the limits the arena asked for."""

from __future__ import annotations

import json

import pytest

from sandkernel.kernels.model.profiles import Profile, resolve_profile
from sandkernel.kernels.sandbox.container import (
    SANDBOX_GID,
    SANDBOX_UID_RANGE,
    SUPERVISOR_ENTRYPOINT,
    host_pids_limit,
)
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.exec_stream import SANDBOX_SHELL
from sandkernel.kernels.sandbox.runtime_dir import CONTAINER_DIR

from ..gateway_fixtures import ALICE, BOB
from .conftest import ATTACKER_LIMITS

pytestmark = [pytest.mark.security, pytest.mark.docker]


MIB = 2**20
# What the profile sets on a container (and the grace the arena asks for); not image, timeouts.
LIMIT_FIELDS = (
    "runtime",
    "memory_mb",
    "cpus",
    "pids",
    "tmp_mb",
    "workspace_mb",
    "nofile",
    "fsize_mb",
    "interrupt_grace",
)
# seccomp actions that refuse: a profile whose default is one of these is an allow-list.
REFUSING_ACTIONS = {"SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD"}


def uid_of(c, p):
    uid, gid = (int(x) for x in c["Config"]["User"].split(":"))
    return SANDBOX_UID_RANGE[0] <= uid < SANDBOX_UID_RANGE[1] and gid == SANDBOX_GID


def seccomp_of(c) -> list[dict]:
    return [json.loads(o[8:]) for o in c["HostConfig"]["SecurityOpt"] if o.startswith("seccomp=")]


def ulimits_of(c) -> dict[str, tuple[int, int]]:
    return {u["Name"]: (u["Soft"], u["Hard"]) for u in c["HostConfig"]["Ulimits"]}


def init_of(c, p) -> bool:
    """PID 1 is catatonit (an init in pause mode) or, in a savable gVisor sandbox (memory
    snapshots), the kernel supervisor started with every signal it does not handle ignored; it
    reaps orphans as an init does (test_escape.py's orphan test runs in both)."""
    entrypoint = c["Config"]["Entrypoint"] or c["Config"]["Cmd"]
    if entrypoint == [SANDBOX_SHELL, "-c", SUPERVISOR_ENTRYPOINT]:
        return c["HostConfig"]["Runtime"] == "runsc"
    return "catatonit" in json.dumps(entrypoint)


def tmpfs_options(c, where: str) -> set[str]:
    return set(c["HostConfig"]["Tmpfs"][where].split(","))


CHECKS = {
    "unprivileged_own_uid": uid_of,
    "not_privileged": lambda c, p: c["HostConfig"]["Privileged"] is False,
    "read_only_root": lambda c, p: c["HostConfig"]["ReadonlyRootfs"] is True,
    "all_caps_dropped": lambda c, p: c["HostConfig"]["CapDrop"] == ["ALL"] and not c["HostConfig"]["CapAdd"],
    "no_new_privileges": lambda c, p: "no-new-privileges:true" in c["HostConfig"]["SecurityOpt"],
    # exactly one profile of our own, an allow-list: what it does not name is refused
    "own_seccomp_profile": lambda c, p: (
        "seccomp=unconfined" not in c["HostConfig"]["SecurityOpt"]
        and len(seccomp_of(c)) == 1
        and seccomp_of(c)[0]["defaultAction"] in REFUSING_ACTIONS
        and bool(seccomp_of(c)[0]["syscalls"])
    ),
    "no_network": lambda c, p: c["HostConfig"]["NetworkMode"] == "none" and not c["NetworkSettings"]["Ports"],
    "private_ipc_pid_uts": lambda c, p: (
        c["HostConfig"]["IpcMode"] == "private"
        and c["HostConfig"]["PidMode"] == ""
        and c["HostConfig"]["UTSMode"] == ""
    ),
    "memory_no_swap": lambda c, p: c["HostConfig"]["Memory"] == c["HostConfig"]["MemorySwap"] == p.memory_mb * MIB,
    "cpu_quota": lambda c, p: c["HostConfig"]["NanoCpus"] == int(p.cpus * 1e9) and not c["HostConfig"]["CpuQuota"],
    "pids_limit": lambda c, p: c["HostConfig"]["PidsLimit"] == host_pids_limit(p),
    "ulimits": lambda c, p: (
        ulimits_of(c) == {"nofile": (p.nofile, p.nofile), "core": (0, 0), "fsize": (p.fsize_mb * MIB, p.fsize_mb * MIB)}
    ),
    "no_core_dumps": lambda c, p: ulimits_of(c)["core"] == (0, 0),
    # the runtime dir and the session's workspace disk (a mount point under the state dir), rprivate
    "only_the_runtime_dir_and_workspace_disk_are_bound": lambda c, p: (
        sorted(m["Destination"] for m in c["Mounts"] if m["Type"] == "bind") == sorted([CONTAINER_DIR, "/workspace"])
        and all(m["Propagation"] == "rprivate" for m in c["Mounts"] if m["Type"] == "bind")
        and all(
            m["Source"].endswith(".mnt") and m["Source"].rsplit("/", 2)[1] == "workspaces"
            for m in c["Mounts"]
            if m["Destination"] == "/workspace"
        )
    ),
    "capped_tmpfs": lambda c, p: (
        set(c["HostConfig"]["Tmpfs"]) == {"/tmp"}
        and {"nosuid", "nodev", "noexec", f"size={p.tmp_mb}m"} <= tmpfs_options(c, "/tmp")
    ),
    "no_docker_socket": lambda c, p: (
        not any("docker.sock" in json.dumps(m) or "containerd" in json.dumps(m) for m in c["Mounts"])
    ),
    "no_devices": lambda c, p: not c["HostConfig"]["Devices"] and not c["HostConfig"].get("DeviceRequests"),
    "no_sysctls_or_extra_groups": lambda c, p: not c["HostConfig"].get("Sysctls") and not c["HostConfig"]["GroupAdd"],
    "init_is_catatonit_or_the_kernel_supervisor": init_of,
    "log_capped": lambda c, p: c["HostConfig"]["LogConfig"]["Config"].get("max-size") == "1m",
    "labelled": lambda c, p: (
        {"sandkernel.session", "sandkernel.kernel", "sandkernel.owner", "sandkernel.uid"} <= set(c["Config"]["Labels"])
    ),
    "no_host_environment": lambda c, p: (
        not any(
            e.split("=", 1)[0] in {"SANDKERNEL_TOKEN", "ANTHROPIC_API_KEY", "DOCKER_HOST", "PYENV_ROOT"}
            for e in c["Config"]["Env"]
        )
    ),
}


async def reported_profile(arena, session: dict, token: str) -> Profile:
    """The limits the gateway says this session has, as a Profile (what the container must show)."""
    status, model = await arena.gateway.request("GET", f"/api/sessions/{session['id']}", token=token)
    assert status == 200, model
    return resolve_profile(overrides={k: model["profile"][k] for k in LIMIT_FIELDS})


def containers_of(arena):
    engine = default_engine()
    found = []
    for session in (arena.attacker, arena.canary):
        [container] = engine.client.containers.list(filters={"label": f"sandkernel.session={session['id']}"})
        found.append(engine.client.api.inspect_container(container.id))
    return found


async def containers_and_profiles(arena) -> list[tuple[dict, Profile]]:
    return list(
        zip(
            containers_of(arena),
            [await reported_profile(arena, arena.attacker, ALICE), await reported_profile(arena, arena.canary, BOB)],
            strict=True,
        )
    )


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_hardened_setting(arena, check):
    for inspected, profile in await containers_and_profiles(arena):
        assert CHECKS[check](inspected, profile), f"{check} fails on {inspected['Name']} ({arena.runtime})"
        assert inspected["HostConfig"]["Runtime"] == arena.runtime


async def test_limits_follow_the_profile_and_uids_differ(arena):
    """The attacker's reported profile is the one the arena asked for (so the exact checks above
    compare with the request, not with an echo of whatever the container got)."""
    (attacker, attacker_profile), (canary, _) = await containers_and_profiles(arena)
    asked = resolve_profile(overrides={"runtime": arena.runtime, **ATTACKER_LIMITS})
    assert {k: getattr(attacker_profile, k) for k in ATTACKER_LIMITS} == ATTACKER_LIMITS
    assert attacker_profile.runtime == asked.runtime
    assert attacker["HostConfig"]["Memory"] == ATTACKER_LIMITS["memory_mb"] * MIB
    assert attacker["HostConfig"]["PidsLimit"] == host_pids_limit(asked)
    assert attacker["Config"]["User"] != canary["Config"]["User"], "two sandboxes must not share a host uid"
