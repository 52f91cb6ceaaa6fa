"""The Docker engine's CPU group (kernels/sandbox/engine_cpu.py): which processes move, what is
written under cgroup v1 and v2, an engine a service manager placed is left alone, and on this
host (after scripts/host-setup.sh) the engine runs at its low weight."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandkernel.kernels.sandbox.engine_cpu import (
    GROUP,
    SYSTEMD_HINT,
    V1_SHARES,
    V2_WEIGHT,
    engine_pids,
    engine_placement,
    place_engine,
)

V1_CGROUP = "12:cpu,cpuacct:{}\n0::/\n"
V2_CGROUP = "0::{}\n"


def fake_process(proc: Path, pid: int, comm: str, parent: int, cgroup: str) -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "comm").write_text(comm + "\n")
    (entry / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1\n")
    (entry / "cgroup").write_text(cgroup)


def engine_tree(proc: Path, where: str, cgroup_line: str = V1_CGROUP) -> None:
    """dockerd (100) -> containerd (101) -> shim (102) -> a container's init (103, its own
    cgroup); an unrelated process (200) in the same group as dockerd."""
    proc.mkdir()
    fake_process(proc, 1, "init", 0, cgroup_line.format("/"))
    fake_process(proc, 100, "dockerd", 1, cgroup_line.format(where))
    fake_process(proc, 101, "containerd", 100, cgroup_line.format(where))
    fake_process(proc, 102, "containerd-shim", 101, cgroup_line.format(where))
    fake_process(proc, 103, "python", 102, cgroup_line.format("/docker/" + "a" * 64))
    fake_process(proc, 200, "sshd", 1, cgroup_line.format(where))


def test_the_engine_and_its_helpers_move_but_not_containers_or_strangers(tmp_path: Path):
    proc = tmp_path / "proc"
    engine_tree(proc, "/")
    assert sorted(engine_pids(proc)) == [100, 101, 102]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_engine_gets_a_group_of_its_own_at_a_low_weight(tmp_path: Path, version: str):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    engine_tree(proc, "/", V1_CGROUP if version == "v1" else V2_CGROUP)
    if version == "v1":
        (root / "cpu").mkdir(parents=True)
        group, weight_file, weight = root / "cpu" / GROUP, "cpu.shares", V1_SHARES
    else:
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpu io memory pids\n")
        (root / "cgroup.subtree_control").write_text("memory pids\n")
        group, weight_file, weight = root / GROUP, "cpu.weight", V2_WEIGHT
    said = place_engine(root, proc)
    assert "3 processes" in said and GROUP in said
    assert (group / weight_file).read_text() == str(weight)
    assert (group / "cgroup.procs").exists()  # a fake file: the last pid written stands in for the kernel's move
    if version == "v2":
        assert (root / "cgroup.subtree_control").read_text() == "+cpu"


def test_an_engine_a_service_manager_placed_is_left_to_it(tmp_path: Path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    engine_tree(proc, "/system.slice/docker.service")
    (root / "cpu").mkdir(parents=True)
    said = place_engine(root, proc)
    assert "/system.slice/docker.service" in said and SYSTEMD_HINT in said
    assert not (root / "cpu" / GROUP).exists()
    weighed, where, fix = engine_placement(root, proc)
    assert not weighed and fix == SYSTEMD_HINT and "service manager" in where


@pytest.mark.skipif(os.geteuid() != 0, reason="host-setup.sh places the engine only as root")
def test_on_this_host_the_engine_runs_at_its_low_weight():
    weighed, where, fix = engine_placement()
    if fix == SYSTEMD_HINT:
        pytest.skip(f"{where}: weighed by the service manager ({fix})")
    assert weighed, f"{where}; fix: {fix}"
