"""The benchmark suite runs end to end (a few samples each): correctness only, no timing asserts.

One test per step of bench/run_all.sh (``--quick --step NAME``), each with its own results
directory and its own xdist group, so a parallel run spreads the steps over its workers instead
of holding one worker for the whole suite (it was the longest test, and under a CPU hog it ran
past its deadline). Each step's checks read what that step wrote and the summary made from it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
RUN_ALL = BENCH / "run_all.sh"
STEP_SECONDS = 600  # one quick step (the longest, time_to_interactive, takes about 60 s on a quiet machine)
TTI_QUICK_N = 1  # bench/run_all.sh --quick: one sample of each time-to-interactive run


def results(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def check_cold_start(folder: Path, summary: str) -> None:
    assert results(folder, "cold_start.json")


def check_execute_roundtrip(folder: Path, summary: str) -> None:
    assert results(folder, "execute_roundtrip.json")


def check_session_acquire(folder: Path, summary: str) -> None:
    acquire = results(folder, "session_acquire.json")
    assert {"warm pool", "cold start", "bare docker run + ipykernel"} <= set(acquire["runc"])
    assert "acquire -> 1+1, warm pool (runc)" in summary and "| measure | sandkernel | baseline |" in summary


def check_time_to_interactive(folder: Path, summary: str) -> None:
    tti = results(folder, "time_to_interactive.json")["runc"]
    cells = {"bare docker run": 2, "pool off": 2, "pool + preload": 2, "pool without preload": 1}
    for contender, count in cells.items():
        assert set(tti["runs"][contender]) == set(tti["modes"]), contender
        for mode, rows in tti["runs"][contender].items():
            assert len(rows) == count and all(r["n"] == TTI_QUICK_N and r["failed"] == 0 for r in rows.values()), (mode, rows)
            if contender != "pool off" and contender.startswith("pool"):  # sized for the run, full first
                assert all(r["from_pool"] == TTI_QUICK_N for r in rows.values()), (contender, mode, rows)
    # The pool's kernels come with the data stack imported (prewarm), before any user cell:
    assert tti["runs"]["pool + preload"]["sequential"]["1+1"]["pandas_already_imported"] == TTI_QUICK_N
    assert {"raw execute 1+1", "warm kernel pandas cell"} <= set(tti["references"])
    assert len(tti["targets"]) == 5 and all(isinstance(t["met"], bool) for t in tti["targets"]), tti["targets"]
    assert f"time to interactive: create -> pandas read_csv, burst, n={TTI_QUICK_N} (runc)" in summary
    assert "target: warm pool -> first pandas read_csv result" in summary


def check_throughput_density(folder: Path, summary: str) -> None:
    assert results(folder, "throughput_density.json")


def check_density(folder: Path, summary: str) -> None:
    density = results(folder, "density.json")["runc"]
    assert density["sessions"] == 4 and density["random_session"]["n"] > 0, density
    assert "idle memory per session, 4 sessions (runc)" in summary


def check_door_roundtrip(folder: Path, summary: str) -> None:
    assert "MCP run_python, legacy MCP session" in results(folder, "door_roundtrip.json")["runc"]


def check_recording_overhead(folder: Path, summary: str) -> None:
    assert results(folder, "recording_overhead.json")


def check_accounting_overhead(folder: Path, summary: str) -> None:
    for workspace, data in results(folder, "accounting_overhead.json")["runc"].items():
        assert {"off", "on", "on, walk every cell"} <= set(data), workspace
        assert data["sample"]["cpu_seconds"] is not None, data["sample"]
        assert not data["watching"] or data["walks_on"] == 0, data  # trivial cells take no walk
    assert "trivial execute with per-cell accounting (runc, empty workspace)" in summary


def check_controls_overhead(folder: Path, summary: str) -> None:
    controls = results(folder, "controls_overhead.json")["runc"]
    assert len(controls) == 3 and all(row["n"] == 5 for row in controls.values()), controls
    assert "controls defaults (accounting + audit) (runc)" in summary


def check_cluster(folder: Path, summary: str) -> None:
    cluster = results(folder, "cluster.json")
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
    assert "cluster: execute 1+1 through another host, p50 (runc)" in summary
    assert "cluster: create throughput, burst of 4 through one endpoint, 3 hosts (runc)" in summary


def check_snapshots(folder: Path, summary: str) -> None:
    for runtime, sizes in results(folder, "snapshots.json").items():
        assert sizes["5 MB"]["restored_by"] == ["replay"] and sizes["5 MB"]["verdicts"] == ["same"], (runtime, sizes)
    assert "pause / resume (replay), 5 MB session (runc)" in summary


def check_agent_roundtrips(folder: Path, summary: str) -> None:
    assert results(folder, "agent_roundtrips.json")


def check_noisy_neighbour(folder: Path, summary: str) -> None:
    noisy = results(folder, "noisy_neighbour.json")["runc"]
    rows = noisy["conditions"]
    assert list(rows) == ["alone", "does all of these at once", "alone, after the noise"], list(rows)
    assert all(row["n"] >= 5 and row["failed"] == 0 for row in rows.values()), rows  # the canary never failed
    noise = rows["does all of these at once"]["noise"]
    assert {kind: row["cycles"] >= 1 for kind, row in noise.items()} == {"freeze": True, "fork": True, "pause": True}
    assert isinstance(noisy["within_target"], bool), noisy
    assert "another tenant's 1+1 p50 / p99 while one tenant does all of these at once, n=" in summary


# What each step of bench/run_all.sh is checked for, in its order (the guard below keeps the two lists one).
CHECKS: dict[str, Callable[[Path, str], None]] = {
    "cold_start": check_cold_start,
    "execute_roundtrip": check_execute_roundtrip,
    "session_acquire": check_session_acquire,
    "time_to_interactive": check_time_to_interactive,
    "throughput_density": check_throughput_density,
    "density": check_density,
    "door_roundtrip": check_door_roundtrip,
    "recording_overhead": check_recording_overhead,
    "accounting_overhead": check_accounting_overhead,
    "controls_overhead": check_controls_overhead,
    "cluster": check_cluster,
    "snapshots": check_snapshots,
    "agent_roundtrips": check_agent_roundtrips,
    "noisy_neighbour": check_noisy_neighbour,
}


def test_every_step_of_run_all_is_checked():
    listed = subprocess.run(["bash", str(RUN_ALL), "--list"], capture_output=True, text=True, timeout=60, check=True)
    assert listed.stdout.split() == list(CHECKS)


@pytest.mark.bench
@pytest.mark.docker
@pytest.mark.timeout(STEP_SECONDS + 60)
@pytest.mark.parametrize(
    "step", [pytest.param(name, marks=pytest.mark.xdist_group(f"bench-{name}"), id=name) for name in CHECKS]
)
def test_a_bench_step_runs_and_summarises(tmp_path, step):
    proc = subprocess.run(
        ["bash", str(RUN_ALL), "--quick", "--step", step],
        capture_output=True,
        text=True,
        timeout=STEP_SECONDS,
        env={**os.environ, "SANDKERNEL_BENCH_RESULTS": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    CHECKS[step](tmp_path, (tmp_path / "SUMMARY.md").read_text())
