"""One tenant cannot outgrow the others (issue 30, item 2): every path that makes a sandbox
holds its room before it starts anything, so concurrent forks cannot each pass one check of the
tenant's limit, nor concurrent resumes one check of the gateway's total (four forks of count 3
at once from one session all answered 201, and the tenant held 14 sessions against a limit of 6)."""

from __future__ import annotations

import asyncio

import pytest

from sandkernel.kernels.lifecycle.reaper import OWNER_LABEL, listed_containers, owner_label
from sandkernel.kernels.sandbox.docker_engine import default_engine

from ..conftest import RUNTIME_PARAMS, require_runtime
from ..gateway_fixtures import ALICE, BOB, start_gateway, stop_gateway

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
