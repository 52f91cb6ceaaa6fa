"""The arena every attack runs in: a real gateway with two tenants, an attacker session (tenant
"alice") and a canary session (tenant "bob"), under runc and under gVisor.

After every test, :meth:`Arena.assert_unharmed` checks that the attack harmed nothing else: the
gateway still serves and its memory stayed bounded, the canary still executes within a liveness
bound, keeps its state and sees nothing but its own result, the canary's transcript is intact in
memory and on disk, the host's disks and the runtime dirs did not fill, no container exists
beyond the arena's, and the host sentinel file is untouched.
Run alone with ``pytest tests/security``; ``-m "not slow"`` is the fast subset.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import pytest

from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label
from sandkernel.kernels.sandbox.runtime_dir import (
    CONNECTION_FILE,
    CONTAINER_DIR,
    SECCOMP_FILE,
    RuntimeDir,
    default_base_dir,
)

from ..conftest import RUNTIME_PARAMS, require_runtime
from ..gateway_fixtures import ALICE, BOB, Gateway, rss_mib, start_gateway, stop_gateway

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

# Bounds of "unharmed". Generous on purpose: they catch an attack that leaks, not a slow machine.
# The gateway runs in this test process, so this process's RSS is the gateway's (plus pytest's).
MAX_GATEWAY_RSS_GROWTH_MIB = 512  # since the arena started (a whole module of attacks)
CANARY_LIVENESS_SECONDS = 30.0  # one canary execute after an attack; a liveness bound, not timing
# Free space of the notebook dir's filesystem and of Docker's, lost during one test. Attacks write
# at most a few hundred MiB anywhere (/tmp is a tmpfs; the workspace a disk image capped at its
# size, under the state dir, which is on the same disk); other jobs on a shared
# machine (image builds) also draw on these disks, hence the headroom.
MAX_DISK_DROP_BYTES = 1 << 30
DOCKER_ROOT = Path("/var/lib/docker")
# A kernel's runtime dir holds its five sockets and two small files; every runtime dir together,
# every test process's included, stays far below this.
MAX_RUNTIME_DIR_BYTES = 1 << 20
MAX_RUNTIME_BASE_BYTES = 64 << 20

# The only outputs a canary execute may show besides its result: its own kernel's warnings.
# Anything else (another tenant's output, a gateway notice) means an attack reached the canary.
KNOWN_KERNEL_WARNINGS: tuple[re.Pattern[str], ...] = (
    # IPython's output cache fills after 1000 results (a long arena's canary gets there).
    re.compile(r".*/IPython/core/displayhook\.py:\d+: UserWarning: Output cache limit \(currently \d+ entries\) hit\."),
    re.compile(r"Flushing oldest \d+ entries\."),
    re.compile(r"\s*warn\('Output cache limit \(currently \{sz\} entries\) hit\.\\n'"),
)


def unexpected_outputs(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outputs of a canary execute that are neither its one ``execute_result`` nor a known
    warning of its own kernel (:data:`KNOWN_KERNEL_WARNINGS`, matched on stderr only)."""
    return [
        o
        for o in outputs
        if o["output_type"] != "execute_result"
        and not (
            o["output_type"] == "stream"
            and o["name"] == "stderr"
            and all(any(p.fullmatch(line) for p in KNOWN_KERNEL_WARNINGS) for line in o["text"].splitlines() if line)
        )
    ]


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under root; entries that vanish while counted (other kernels
    come and go) are skipped."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def disks_to_watch(notebook_dir: Path) -> list[Path]:
    """The notebook dir's filesystem and Docker's data root (where it exists and is readable)."""
    return [p for p in (notebook_dir, DOCKER_ROOT) if p.exists()]


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
    rss_at_start_mib: float = field(default_factory=rss_mib)
    disk_free_before: dict[Path, int] = field(default_factory=dict)

    @property
    def canary_transcript(self) -> Path:
        """The canary's notebook on disk, as the gateway's session model names it."""
        return Path(self.canary["path"])

    def checkpoint(self) -> None:
        """Called before each test: the free space the test is measured against."""
        self.disk_free_before = {p: free_bytes(p) for p in disks_to_watch(self.canary_transcript.parent)}

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
        self.canary_cells += 1
        outputs = reply["outputs"]
        results = [o for o in outputs if o["output_type"] == "execute_result"]
        assert len(results) == 1, f"the canary's reply holds {len(results)} results: {outputs}"
        assert results[0]["data"]["text/plain"] == "84", f"the canary lost its state: {outputs}"
        assert not unexpected_outputs(outputs), f"the canary saw outputs that are not its own: {outputs}"
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
        took = await self.canary_execute()
        assert took < CANARY_LIVENESS_SECONDS, (
            f"the canary took {took:.1f} s to execute (bound {CANARY_LIVENESS_SECONDS})"
        )
        status, notebook = await self.gateway.request("GET", f"/api/sessions/{self.canary['id']}/notebook", token=BOB)
        assert status == 200
        nb = nbformat.from_dict(notebook)
        nbformat.validate(nb)
        cells = [c for c in nb.cells if c.cell_type == "code"]
        assert len(cells) == self.canary_cells and cells[0].source == "canary_value = 42", "canary transcript harmed"
        self.assert_transcript_on_disk([c.source for c in cells])
        assert self.sentinel.read_text() == self.sentinel_text, "the host sentinel file changed"
        assert not Path("/tmp/sandkernel-pwned").exists()
        known = {self.attacker["id"], self.canary["id"], *self.extra_sessions}
        # sparse: the list's own data, no inspect per container (one could vanish in between)
        ours = default_engine().client.containers.list(
            all=True, sparse=True, filters={"label": f"{OWNER_LABEL}={owner_label()}"}
        )
        strays = [c.attrs["Names"] for c in ours if c.attrs["Labels"].get("sandkernel.session") not in known]
        assert not strays, f"containers beyond the arena's: {strays}"
        status, _ = await self.gateway.request("GET", f"/api/sessions/{self.attacker['id']}")
        assert status == 200, "the attacker's own session should survive its attack"
        self.assert_host_resources()

    def assert_transcript_on_disk(self, sources: list[str]) -> None:
        """The file itself (the audit record), not the gateway's copy in memory: valid nbformat,
        the same code cells. Called right after the notebook GET, which waits for the disk."""
        on_disk = nbformat.read(self.canary_transcript, as_version=4)
        nbformat.validate(on_disk)
        assert [c.source for c in on_disk.cells if c.cell_type == "code"] == sources, "canary transcript on disk harmed"

    def assert_host_resources(self) -> None:
        growth = rss_mib() - self.rss_at_start_mib
        assert growth < MAX_GATEWAY_RSS_GROWTH_MIB, f"the gateway grew {growth:.0f} MiB since the arena started"
        for path, before in self.disk_free_before.items():
            dropped = before - free_bytes(path)
            assert dropped < MAX_DISK_DROP_BYTES, f"free space under {path} dropped by {dropped >> 20} MiB in one test"
        for path in self.runtime_dirs():
            sockets = {p.name for p in RuntimeDir(path).socket_paths()}
            expected = {CONNECTION_FILE, SECCOMP_FILE} | sockets
            entries = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(path)}
            assert set(entries) <= expected, (
                f"unexpected entries in runtime dir {path}: {sorted(set(entries) - expected)}"
            )
            sockets &= set(entries)
            assert all(stat.S_ISSOCK(entries[n].st_mode) for n in sockets), f"non-socket in {path}: {entries}"
            assert all(stat.S_ISREG(entries[n].st_mode) for n in set(entries) - sockets), f"odd file in {path}"
            size = sum(st.st_size for st in entries.values())
            assert size < MAX_RUNTIME_DIR_BYTES, f"runtime dir {path} holds {size} bytes"
        base = default_base_dir()
        total = tree_bytes(base)
        assert total < MAX_RUNTIME_BASE_BYTES, f"runtime dirs under {base} hold {total >> 20} MiB"

    def runtime_dirs(self) -> list[Path]:
        """The host side of the arena sessions' runtime dirs, from their containers' bind mounts
        (a session whose container is being replaced right now has none to check)."""
        found = []
        engine = default_engine()
        for session in (self.attacker, self.canary):
            for c in engine.client.containers.list(
                sparse=True, filters={"label": f"sandkernel.session={session['id']}"}
            ):
                found += [Path(m["Source"]) for m in c.attrs["Mounts"] if m["Destination"] == CONTAINER_DIR]
        return found


@pytest.fixture(scope="module", params=RUNTIME_PARAMS)
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
        yield Arena(gateway, runtime, attacker, canary, sentinel, sentinel_text, rss_at_start_mib=rss_mib())
    finally:
        await stop_gateway(gateway)
        sentinel.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
async def unharmed(request):
    """Every test in this suite that uses the arena ends by proving nothing else was harmed."""
    arena = request.getfixturevalue("arena") if "arena" in request.fixturenames else None
    if arena is not None:
        arena.checkpoint()
    yield
    if arena is not None:
        await arena.assert_unharmed()


def record_slowdown(runtime: str, attack: str, idle: float, during: list[float]) -> None:
    """Keep the canary's latency during an attack, for docs/security.md (never asserted). The
    report is read, updated and rewritten under a lock: the workers of a parallel run share it."""
    worst = max(during) if during else None
    entry = {
        "canary_idle_ms": round(idle * 1000, 1),
        "canary_during_p50_ms": round(sorted(during)[len(during) // 2] * 1000, 1) if during else None,
        "canary_during_max_ms": round(worst * 1000, 1) if worst else None,
        "samples": len(during),
    }
    SLOWDOWN_RESULTS.parent.mkdir(exist_ok=True)
    with open(SLOWDOWN_RESULTS.with_name(SLOWDOWN_RESULTS.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(SLOWDOWN_RESULTS.read_text()) if SLOWDOWN_RESULTS.exists() else {}
        data.setdefault(runtime, {})[attack] = entry
        SLOWDOWN_RESULTS.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
