"""One tenant cannot outgrow the others (issue 30, item 2): every path that makes a sandbox
holds its room before it starts anything, so concurrent forks cannot each pass one check of the
tenant's limit, nor concurrent resumes one check of the gateway's total (four forks of count 3
at once from one session all answered 201, and the tenant held 14 sessions against a limit of 6)."""

from __future__ import annotations

import asyncio
import json

import pytest

from sandkernel.kernels.lifecycle.reaper import listed_containers
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label

from ..conftest import RUNTIME_PARAMS, container_ids_of, require_runtime
from ..gateway_fixtures import ALICE, BOB, start_gateway, stop_gateway
from ..test_audit import records as audit_records

pytestmark = [pytest.mark.security, pytest.mark.docker]


def sandboxes_of_this_process() -> int:
    """Containers this test process's gateways made (and have not removed)."""
    return sum(1 for c in listed_containers(default_engine()) if c.labels.get(OWNER_LABEL) == owner_label())


async def execute(gw, session_id: str, code: str, token: str = ALICE) -> dict:
    status, reply = await gw.request(
        "POST", f"/api/sessions/{session_id}/execute", {"code": code, "timeout": 300}, token=token
    )
    assert status == 200 and reply["status"] == "ok", reply
    return reply


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_concurrent_forks_cannot_pass_the_tenants_limit_together(tmp_path, runtime):
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, max_sessions=3)
    try:
        _, parent = await gw.request("POST", "/api/sessions", {})
        await execute(gw, parent["id"], "x = 41")
        before = await asyncio.to_thread(sandboxes_of_this_process)
        # Each fork of two fits alone (1 + 2 = 3); together they would make eight.
        answers = await asyncio.gather(
            *(gw.request("POST", f"/api/sessions/{parent['id']}/fork", {"count": 2}) for _ in range(4))
        )
        made = [body for status, body in answers if status == 201]
        refused = [body for status, body in answers if status == 429]
        assert len(made) == 1 and len(refused) == 3, answers
        assert all("session limit reached (3 per token)" in body["message"] for body in refused), refused
        status, listed = await gw.request("GET", "/api/sessions")
        assert status == 200 and len(listed) == 3, listed
        assert await asyncio.to_thread(sandboxes_of_this_process) == before + 2  # the refused ones started nothing
        for fork in made[0]["forks"]:  # the forks made work, with the parent's state
            assert (await execute(gw, fork["session"]["id"], "print(x + 1)"))["outputs"][0]["text"] == "42\n"
        # The room the refused forks held is free again: none of it leaked.
        await gw.request("DELETE", f"/api/sessions/{made[0]['forks'][0]['session']['id']}")
        status, again = await gw.request("POST", f"/api/sessions/{parent['id']}/fork", {"count": 1})
        assert status == 201, again
    finally:
        await stop_gateway(gw)


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
async def test_concurrent_resumes_cannot_pass_the_gateways_total_together(tmp_path, runtime):
    require_runtime(runtime)
    gw = await start_gateway(tmp_path, default_runtime=runtime, max_sessions=4, max_sessions_total=2)
    try:
        paused = []
        for value in (1, 2):
            _, session = await gw.request("POST", "/api/sessions", {})
            await execute(gw, session["id"], f"v = {value}")
            status, body = await gw.request("POST", f"/api/sessions/{session['id']}/pause")
            assert status == 200, body
            paused.append(session["id"])
        status, other = await gw.request("POST", "/api/sessions", {}, token=BOB)  # one of the two places
        assert status == 201, other
        answers = await asyncio.gather(*(gw.request("POST", f"/api/sessions/{sid}/resume") for sid in paused))
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200, 429], answers
        refused, body = next((sid, body) for sid, (status, body) in zip(paused, answers, strict=True) if status == 429)
        assert "at its limit of 2 sessions" in body["message"], body
        status, model = await gw.request("GET", f"/api/sessions/{refused}")
        assert status == 200 and model["state"] == "paused", model  # kept paused, its snapshot intact
        await gw.request("DELETE", f"/api/sessions/{other['id']}", token=BOB)
        status, body = await gw.request("POST", f"/api/sessions/{refused}/resume")
        assert status == 200, body
        shown = [(await execute(gw, sid, "print(v)"))["outputs"][0]["text"] for sid in paused]
        assert shown == ["1\n", "2\n"], shown  # each resumed with its own state
    finally:
        await stop_gateway(gw)


@pytest.mark.parametrize("runtime", [RUNTIME_PARAMS[0]])
async def test_a_fork_inherits_its_parents_lifetime(tmp_path, runtime):
    """Issue 30, item 9: a fork got a fresh creation time, so forking renewed --max-lifetime for
    ever. The fork counts from its parent's start, in the registry and in its catalog record (a
    later gateway that adopts it counts the same). The parent's age is set behind the API and
    the culler is run once by hand: no waiting on the clock."""
    require_runtime(runtime)
    lifetime = 3600.0
    gw = await start_gateway(tmp_path, default_runtime=runtime, max_lifetime=lifetime)
    try:
        _, parent = await gw.request("POST", "/api/sessions", {})
        await execute(gw, parent["id"], "x = 1")
        registry = gw.server.registry
        managed = registry.get("alice", parent["id"])
        managed.created_mono -= lifetime - 60  # it has a minute left
        status, body = await gw.request("POST", f"/api/sessions/{parent['id']}/fork", {"count": 1})
        assert status == 201, body
        fork_id = body["forks"][0]["session"]["id"]
        fork = registry.get("alice", fork_id)
        assert fork.created_mono == managed.created_mono
        assert fork.gateway_record()["lifetime_from"] == managed.created
        registry.settings = registry.settings.replace(max_lifetime=lifetime - 120)  # both are past it now
        culled = await registry.cull()
        assert sorted(culled) == sorted([parent["id"], fork_id])
        for sid in (parent["id"], fork_id):
            status, _ = await gw.request("GET", f"/api/sessions/{sid}")
            assert status in (404, 410), sid
    finally:
        await stop_gateway(gw)


@pytest.mark.parametrize("runtime", [RUNTIME_PARAMS[0]])
async def test_a_resume_under_narrower_settings_is_refused_and_the_session_stays_paused(tmp_path, runtime):
    """Issue 30, item 9: a resume started the sandbox from the profile its snapshot recorded, so
    a session paused before the operator lowered a ceiling came back above it. It is checked
    against the operator's current settings; one that no longer fits is a 409 that says why,
    starts nothing, and stays paused with its snapshot (deleting it still works)."""
    require_runtime(runtime)
    state_dir = tmp_path / "state"
    gw = await start_gateway(tmp_path, default_runtime=runtime, on_exit="keep", state_dir=state_dir)
    running = True
    try:
        _, session = await gw.request("POST", "/api/sessions", {"limits": {"memory_mb": 2048}})
        sid = session["id"]
        await execute(gw, sid, "x = 41")
        status, paused = await gw.request("POST", f"/api/sessions/{sid}/pause")
        assert status == 200, paused
        await stop_gateway(gw)  # on_exit keep: the paused session stays in the catalog
        running = False
        profiles = tmp_path / "profiles.json"
        profiles.write_text(json.dumps({"default": {"ceilings": {"memory_mb": 1024}}}))
        gw = await start_gateway(
            tmp_path, default_runtime=runtime, on_exit="delete", state_dir=state_dir, profiles_file=profiles
        )
        running = True
        for call in (("POST", f"/api/sessions/{sid}/resume", None), ("POST", f"/api/sessions/{sid}/execute", {"code": "x"})):
            status, refused = await gw.request(*call)
            assert status == 409, (call, refused)
            assert "no longer fits this gateway's settings" in refused["message"], refused
            assert "memory_mb=2048 is over profile 'default''s ceiling" in refused["message"], refused
        assert await asyncio.to_thread(container_ids_of, sid) == []  # nothing was started
        status, model = await gw.request("GET", f"/api/sessions/{sid}")
        assert status == 200 and model["state"] == "paused" and model["snapshot"]["bytes"] > 0, model
        status, _ = await gw.request("DELETE", f"/api/sessions/{sid}")
        assert status == 204
    finally:
        if running:
            await stop_gateway(gw)


@pytest.mark.parametrize("runtime", [RUNTIME_PARAMS[0]])
async def test_replayed_cells_pass_the_operators_current_policy_and_are_audited(tmp_path, runtime):
    """Issue 30, item 9: a resume replayed the session's cells before the policy and the audit
    were attached, so code the operator has since forbidden ran again, unrecorded. Replayed cells
    pass the gates new code passes (the policy as it is now) and each has its audit record."""
    require_runtime(runtime)
    state_dir, audit_dir = tmp_path / "state", tmp_path / "audit"
    gw = await start_gateway(tmp_path, default_runtime=runtime, on_exit="keep", state_dir=state_dir, audit_dir=audit_dir)
    running = True
    try:
        _, session = await gw.request("POST", "/api/sessions", {})
        sid = session["id"]
        await execute(gw, sid, "import subprocess\nran = subprocess.run(['true']).returncode")
        await execute(gw, sid, "y = 2")
        status, paused = await gw.request("POST", f"/api/sessions/{sid}/pause")
        assert status == 200, paused
        await stop_gateway(gw)
        running = False
        policy = tmp_path / "exec-policy.toml"
        policy.write_text('default = "allow"\nentry_points = false\n[rules]\nsubprocess = "deny"\n')
        gw = await start_gateway(
            tmp_path,
            default_runtime=runtime,
            on_exit="delete",
            state_dir=state_dir,
            audit_dir=audit_dir,
            exec_policy_file=policy,
        )
        running = True
        status, resumed = await gw.request("POST", f"/api/sessions/{sid}/resume")
        assert status == 200, resumed
        verdicts = [cell["verdict"] for cell in resumed["cells"]]
        assert verdicts[1] == "same" and verdicts[0] != "same", resumed["cells"]  # the forbidden one did not run
        status, reply = await gw.request("POST", f"/api/sessions/{sid}/execute", {"code": "print('ran' in dir(), y)"})
        assert status == 200 and reply["outputs"][0]["text"] == "False 2\n", reply
    finally:
        if running:
            await stop_gateway(gw)
    replayed = [
        r
        for r in audit_records(audit_dir)
        if r["event"] == "execution" and r.get("session") == sid and r.get("door") == "replay"
    ]
    assert [r["status"] for r in replayed] == ["refused", "ok"], replayed
