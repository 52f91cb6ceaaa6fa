"""The benchmark suite runs end to end (a few samples each): correctness only, no timing asserts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker

BENCH = Path(__file__).parents[1] / "bench"


@pytest.mark.bench
@pytest.mark.docker
@pytest.mark.timeout(900)  # the quick suite takes about 5 minutes here; pytest's default 300 s is per ordinary test
def test_bench_suite_runs_and_summarises(tmp_path):
    proc = subprocess.run(
        ["bash", str(BENCH / "run_all.sh"), "--quick"],
        capture_output=True,
        text=True,
        timeout=840,  # the whole quick suite, a few samples each, under runc
        env={**__import__("os").environ, "SANDKERNEL_BENCH_RESULTS": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    acquire = json.loads((tmp_path / "session_acquire.json").read_text())
    assert {"warm pool", "cold start", "bare docker run + ipykernel"} <= set(acquire["runc"])
    names = ("cold_start.json", "execute_roundtrip.json", "recording_overhead.json", "agent_roundtrips.json")
    assert "MCP run_python, legacy MCP session" in json.loads((tmp_path / "door_roundtrip.json").read_text())["runc"]
    for name in (*names, "throughput_density.json"):
        assert json.loads((tmp_path / name).read_text()), name
    accounting = json.loads((tmp_path / "accounting_overhead.json").read_text())
    for workspace, data in accounting["runc"].items():
        assert {"off", "on", "on, walk every cell"} <= set(data), workspace
        assert data["sample"]["cpu_seconds"] is not None, data["sample"]
        assert not data["watching"] or data["walks_on"] == 0, data  # trivial cells take no walk
    controls = json.loads((tmp_path / "controls_overhead.json").read_text())["runc"]
    assert len(controls) == 3 and all(row["n"] == 5 for row in controls.values()), controls
    for runtime, sizes in json.loads((tmp_path / "snapshots.json").read_text()).items():
        assert sizes["5 MB"]["restored_by"] == ["replay"] and sizes["5 MB"]["verdicts"] == ["same"], (runtime, sizes)
    tti = json.loads((tmp_path / "time_to_interactive.json").read_text())["runc"]
    cells = {"bare docker run": 2, "pool off": 2, "pool + preload": 2, "pool without preload": 1}
    for contender, count in cells.items():
        assert set(tti["runs"][contender]) == set(tti["modes"]), contender
        for mode, rows in tti["runs"][contender].items():
            assert len(rows) == count and all(r["n"] == 2 and r["failed"] == 0 for r in rows.values()), (mode, rows)
            if contender != "pool off" and contender.startswith("pool"):  # sized for the run, full first
                assert all(r["from_pool"] == 2 for r in rows.values()), (contender, mode, rows)
    # The pool's kernels come with the data stack imported (prewarm), before any user cell:
    assert tti["runs"]["pool + preload"]["sequential"]["1+1"]["pandas_already_imported"] == 2
    assert {"raw execute 1+1", "warm kernel pandas cell"} <= set(tti["references"])
    assert len(tti["targets"]) == 5 and all(isinstance(t["met"], bool) for t in tti["targets"]), tti["targets"]
    density = json.loads((tmp_path / "density.json").read_text())["runc"]
    assert density["sessions"] == 4 and density["random_session"]["n"] > 0, density
    cluster = json.loads((tmp_path / "cluster.json").read_text())
    # execute and stream, straight and forwarded, and the execute of a direct_to_owner client
    assert cluster["quick"] and len(cluster["forwarding"]) == 5, cluster["forwarding"]
    assert [row["n"] for row in (cluster["forwarding"] | cluster["create"]).values()] == [5] * 5 + [1, 1], cluster
    assert [isinstance(t["met"], bool) for t in cluster["targets"]] == [True, True], cluster["targets"]
    assert len(cluster["create"]) == 2 and isinstance(cluster["targets"][0]["met"], bool), cluster
    bursts = {name: setting["bursts"] for name, setting in cluster["throughput"].items()}
    assert {name: [b["failed"] for b in runs] for name, runs in bursts.items()} == {"1 host": [0], "3 hosts": [0]}
    # Placement: the pair puts every create on host-a (host-f's room is 1); the trio only on its own hosts.
    assert bursts["1 host"][0]["spread"] == {"host-a": 4, "host-f": 0}, bursts
    assert sum(bursts["3 hosts"][0]["spread"].values()) == 4, bursts
    summary = (tmp_path / "SUMMARY.md").read_text()
    assert "idle memory per session, 4 sessions (runc)" in summary
    assert "trivial execute with per-cell accounting (runc, empty workspace)" in summary
    assert "controls defaults (accounting + audit) (runc)" in summary
    assert "pause / resume (replay), 5 MB session (runc)" in summary
    assert "cluster: execute 1+1 through another host, p50 (runc)" in summary
    assert "cluster: create throughput, burst of 4 through one endpoint, 3 hosts (runc)" in summary
    assert "time to interactive: create -> pandas read_csv, burst, n=2 (runc)" in summary
    assert "target: warm pool -> first pandas read_csv result" in summary
    assert "acquire -> 1+1, warm pool (runc)" in summary and "| measure | sandkernel | baseline |" in summary
