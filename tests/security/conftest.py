"""The arena every attack runs in: a real gateway with two tenants, an attacker session (tenant
"alice") and a canary session (tenant "bob"), under runc and under gVisor.

After every test, :meth:`Arena.assert_unharmed` checks that the attack harmed nothing else: the
gateway still serves, the canary still executes and keeps its state, the canary's transcript is
intact, no container exists beyond the arena's, and the host sentinel file is untouched.
Run alone with ``pytest tests/security``; ``-m "not slow"`` is the fast subset.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest

from sandkernel.kernels.docker_engine import default_engine
from sandkernel.kernels.reaper import OWNER_LABEL, owner_label

from ..conftest import RUNTIMES, require_runtime
from ..gateway_fixtures import ALICE, BOB, Gateway, start_gateway, stop_gateway

ATTACKER_LIMITS = {
    "memory_mb": 384,
    "pids": 96,
    "tmp_mb": 64,
    "workspace_mb": 128,
    "fsize_mb": 32,
    "nofile": 256,
    "interrupt_grace": 2,
}
# The canary's latency under each resource attack is written here (docs/security.md quotes a run).
SLOWDOWN_RESULTS = Path(os.environ.get("SANDKERNEL_SLOWDOWN_REPORT", "/tmp/sandkernel-security-slowdown.json"))


@dataclass
class Arena:
    gateway: Gateway
    runtime: str
    attacker: dict[str, Any]
    canary: dict[str, Any]
    sentinel: Path
    sentinel_text: str
    canary_cells: int = 1
    extra_sessions: set[str] = field(default_factory=set)

    async def attack(self, code: str, timeout: float = 60, token: str = ALICE) -> dict[str, Any]:
        """Run hostile code in the attacker's session; returns the execute reply."""
        status, reply = await self.gateway.request(
            "POST", f"/api/sessions/{self.attacker['id']}/execute", {"code": code, "timeout": timeout}, token=token
        )
        assert status == 200, reply
        return reply

    async def probe(self, code: str, timeout: float = 60) -> Any:
        """Hostile code that prints one JSON document as its last line; returns it decoded."""
        reply = await self.attack(code, timeout)
        assert reply["status"] == "ok", reply
        return json.loads(reply["text"].strip().splitlines()[-1])

    async def canary_execute(self) -> float:
        """One canary execute (state check included); returns its latency in seconds."""
        started = time.monotonic()
        status, reply = await self.gateway.request(
            "POST", f"/api/sessions/{self.canary['id']}/execute", {"code": "canary_value * 2", "timeout": 60}, token=BOB
        )
        took = time.monotonic() - started
        assert status == 200 and reply["status"] == "ok", reply
        assert reply["outputs"][0]["data"]["text/plain"] == "84", "the canary lost its state"
        self.canary_cells += 1
        return took

    async def canary_run(self, code: str) -> dict[str, Any]:
        """Run code as the canary tenant (counted in its transcript)."""
        status, reply = await self.gateway.request(
            "POST", f"/api/sessions/{self.canary['id']}/execute", {"code": code, "timeout": 60}, token=BOB
        )
        assert status == 200, reply
        self.canary_cells += 1
        return reply

    async def assert_unharmed(self) -> None:
        status, health = await self.gateway.request("GET", "/api/health", token=None)
        assert status == 200 and health["status"] == "ok", "the gateway stopped serving"
        await self.canary_execute()
        status, notebook = await self.gateway.request("GET", f"/api/sessions/{self.canary['id']}/notebook", token=BOB)
        assert status == 200
        nb = nbformat.from_dict(notebook)
        nbformat.validate(nb)
        cells = [c for c in nb.cells if c.cell_type == "code"]
        assert len(cells) == self.canary_cells and cells[0].source == "canary_value = 42", "canary transcript harmed"
        assert self.sentinel.read_text() == self.sentinel_text, "the host sentinel file changed"
        assert not Path("/tmp/sandkernel-pwned").exists()
        known = {self.attacker["id"], self.canary["id"], *self.extra_sessions}
        ours = default_engine().client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"})
        strays = [c.name for c in ours if c.labels.get("sandkernel.session") not in known]
        assert not strays, f"containers beyond the arena's: {strays}"
        status, _ = await self.gateway.request("GET", f"/api/sessions/{self.attacker['id']}")
        assert status == 200, "the attacker's own session should survive its attack"


@pytest.fixture(scope="module", params=RUNTIMES)
async def arena(request, tmp_path_factory):
    runtime = request.param
    require_runtime(runtime)
    gateway = await start_gateway(tmp_path_factory.mktemp(f"security-{runtime}"), max_sessions=6)
    sentinel = Path(f"/tmp/sandkernel-sentinel-{uuid.uuid4().hex}")
    sentinel_text = f"host sentinel {uuid.uuid4().hex}"
    sentinel.write_text(sentinel_text)
    try:
        _, attacker = await gateway.request(
            "POST", "/api/sessions", {"limits": {"runtime": runtime, **ATTACKER_LIMITS}}, token=ALICE
        )
        _, canary = await gateway.request("POST", "/api/sessions", {"limits": {"runtime": runtime}}, token=BOB)
        assert "id" in attacker and "id" in canary, (attacker, canary)
        status, reply = await gateway.request(
            "POST", f"/api/sessions/{canary['id']}/execute", {"code": "canary_value = 42"}, token=BOB
        )
        assert status == 200 and reply["status"] == "ok"
        yield Arena(gateway, runtime, attacker, canary, sentinel, sentinel_text)
    finally:
        await stop_gateway(gateway)
        sentinel.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
async def unharmed(request):
    """Every test in this suite that uses the arena ends by proving nothing else was harmed."""
    yield
    if "arena" in request.fixturenames:
        await request.getfixturevalue("arena").assert_unharmed()


def record_slowdown(runtime: str, attack: str, idle: float, during: list[float]) -> None:
    """Keep the canary's latency during an attack, for docs/security.md (never asserted)."""
    data = json.loads(SLOWDOWN_RESULTS.read_text()) if SLOWDOWN_RESULTS.exists() else {}
    worst = max(during) if during else None
    data.setdefault(runtime, {})[attack] = {
        "canary_idle_ms": round(idle * 1000, 1),
        "canary_during_p50_ms": round(sorted(during)[len(during) // 2] * 1000, 1) if during else None,
        "canary_during_max_ms": round(worst * 1000, 1) if worst else None,
        "samples": len(during),
    }
    SLOWDOWN_RESULTS.parent.mkdir(exist_ok=True)
    SLOWDOWN_RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
