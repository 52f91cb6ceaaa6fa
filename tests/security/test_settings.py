"""A tenant's settings are hostile too: a session may not mount host directories, pick an image,
an environment or a weaker runtime, or exceed the operator's ceilings (issue 11, item 1; item 9).

Each refusal is a clear 4xx naming the setting (and the allowed range), no container is created
for it, and the arena's canary is unharmed (checked after every test)."""

from __future__ import annotations

import json

import pytest

from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label

from ..conftest import require_runtime
from ..gateway_fixtures import ALICE, start_gateway, stop_gateway

pytestmark = [pytest.mark.security, pytest.mark.docker]

# (limits, status, words the message must contain)
HOSTILE_SETTINGS = {
    "host_root_as_wheelhouse": ({"wheelhouse": "/"}, 403, ["wheelhouse can only be set by the operator"]),
    "host_tmp_as_wheelhouse": ({"wheelhouse": "/dev/shm"}, 403, ["wheelhouse can only be set by the operator"]),
    "any_local_image": ({"image": "sandkernel-base:bookworm"}, 403, ["image can only be set by the operator"]),
    "preload_environment": ({"env": {"LD_PRELOAD": "/workspace/x.so"}}, 403, ["env can only be set by the operator"]),
    "memory_64_gib": ({"memory_mb": 65536}, 400, ["memory_mb=65536", "ceiling", "use 64 to 4096"]),
    "pids_32768": ({"pids": 32768}, 400, ["pids=32768", "ceiling", "use 16 to 1024"]),
    "cpus_64": ({"cpus": 64}, 400, ["cpus=64", "ceiling", "use 0.05 to 2"]),
    "workspace_256_gib": ({"workspace_mb": 262144}, 400, ["workspace_mb=262144", "use 1 to 8192"]),
    "day_long_timeout": ({"execute_timeout": 86400}, 400, ["execute_timeout=86400", "use 0.1 to 3600"]),
}


def session_containers() -> set[str]:
    """This test process's sandboxes (other processes may share the engine)."""
    engine = default_engine()
    return {c.id for c in engine.client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"})}


@pytest.mark.parametrize("case", sorted(HOSTILE_SETTINGS))
async def test_hostile_session_settings_are_refused(arena, case):
    limits, expected, words = HOSTILE_SETTINGS[case]
    before = session_containers()
    status, body = await arena.gateway.request("POST", "/api/sessions", {"limits": limits}, token=ALICE)
    assert status == expected, (status, body)
    assert set(body) == {"error", "message"}, body
    for word in words:
        assert word in body["message"], body
    assert session_containers() <= before, "a refused session must not leave a container"
    status, sessions = await arena.gateway.request("GET", "/api/sessions", token=ALICE)
    assert [s["id"] for s in sessions] == [arena.attacker["id"]]


async def test_profiles_tell_tenants_what_they_may_ask(arena):
    status, profiles = await arena.gateway.request("GET", "/api/profiles", token=ALICE)
    assert status == 200 and set(profiles) == {"default", "small", "large"}
    default = profiles["default"]
    assert default["ceilings"]["memory_mb"] == 4096 and default["ceilings"]["runtimes"] == ["runc", "runsc"]
    assert "wheelhouse" not in default["defaults"] and "env" not in default["defaults"]


async def test_gvisor_by_default_and_runc_only_where_the_operator_allows(tmp_path):
    """Item 9: with --default-runtime auto (the default) and runsc registered, sessions and
    kernels run under gVisor; asking for runc is refused unless the operator's profile offers it."""
    require_runtime("runsc")
    gateway = await start_gateway(tmp_path, default_runtime="auto")
    try:
        status, specs = await gateway.request("GET", "/api/kernelspecs")
        assert status == 200 and specs["default"] == "sandkernel-python-gvisor"
        assert list(specs["kernelspecs"]) == ["sandkernel-python-gvisor"]
        status, body = await gateway.request("POST", "/api/sessions", {"limits": {"runtime": "runc"}})
        assert status == 403 and "runtime runc is not offered by profile 'default'" in body["message"], body
        status, body = await gateway.request("POST", "/api/kernels", {"name": "sandkernel-python"})
        assert status == 403 and "runtime runc is not offered" in body["message"], body
        status, session = await gateway.request("POST", "/api/sessions", {})
        assert status == 201 and session["profile"]["runtime"] == "runsc", session
        [container] = default_engine().client.containers.list(filters={"label": f"sandkernel.session={session['id']}"})
        assert container.attrs["HostConfig"]["Runtime"] == "runsc"
    finally:
        await stop_gateway(gateway)


async def test_operator_profiles_file_grants_what_tenants_cannot_ask(tmp_path):
    """The operator's own settings (a wheelhouse, env, a runc profile) come from --profiles."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "marker.txt").write_text("operator wheels")
    profiles = tmp_path / "profiles.json"
    profiles.write_text(
        json.dumps(
            {
                "analyst": {
                    "extends": "small",
                    "runtime": "runc",
                    "wheelhouse": str(wheels),
                    "env": {"ANALYST": "yes"},
                    "ceilings": {"memory_mb": 768, "runtimes": ["runc"]},
                }
            }
        )
    )
    gateway = await start_gateway(tmp_path, profiles_file=str(profiles), default_runtime="runc")
    try:
        status, body = await gateway.request("POST", "/api/sessions", {"profile": "analyst", "limits": {"memory_mb": 1024}})
        assert status == 400 and "use 64 to 768" in body["message"], body
        status, body = await gateway.request("POST", "/api/sessions", {"profile": "analyst", "limits": {"runtime": "runsc"}})
        assert status == 403 and "offers ['runc']" in body["message"], body
        status, session = await gateway.request("POST", "/api/sessions", {"profile": "analyst", "limits": {"memory_mb": 700}})
        assert status == 201, session
        assert session["profile"]["memory_mb"] == 700 and session["profile"]["name"] == "analyst"
        status, reply = await gateway.request(
            "POST",
            f"/api/sessions/{session['id']}/execute",
            {"code": "import os; print(open('/wheels/marker.txt').read(), os.environ['ANALYST'], os.access('/wheels', os.W_OK))"},
        )
        assert status == 200 and reply["text"] == "operator wheels yes False\n", reply
        # The operator's host path and environment are never shown to the tenant.
        status, notebook = await gateway.request("GET", f"/api/sessions/{session['id']}/notebook")
        shown = json.dumps([session, notebook["metadata"]])
        assert status == 200 and str(wheels) not in shown and "ANALYST" not in shown, shown
    finally:
        await stop_gateway(gateway)
