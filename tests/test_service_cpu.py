"""CPU groups of the host's services (kernels/sandbox/service_cpu.py): which processes move, what
is written under cgroup v1 and v2, a service a manager placed is left alone, and on this host the
engine (after scripts/host-setup.sh) and a ``sandkernel serve`` run at their weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from sandkernel.gateway.auth import new_token
from sandkernel.kernels.sandbox.service_cpu import (
    ENGINE,
    GATEWAY,
    GATEWAY_BULK,
    cpu_cgroup,
    engine_pids,
    engine_placement,
    place_bulk_thread,
    place_engine,
    place_gateway,
)
from sandkernel.kernels.snapshots.store import TRASH_PREFIX

from .gateway_fixtures import free_port

V1_CGROUP = "12:cpu,cpuacct:{}\n0::/\n"
V2_CGROUP = "0::{}\n"
HOST_NET, LAB_NET = "net:[4026531840]", "net:[4026532999]"
HOST_MNT, SANDBOX_MNT = "mnt:[4026531841]", "mnt:[4026532998]"
START_SECONDS = 60.0  # a liveness bound on a gateway's start, not a timing


def fake_process(
    proc: Path, pid: int | str, comm: str, parent: int, cgroup: str, net: str = HOST_NET, mnt: str = HOST_MNT
) -> None:
    entry = proc / str(pid)
    (entry / "ns").mkdir(parents=True)
    (entry / "ns" / "net").symlink_to(net)
    (entry / "ns" / "mnt").symlink_to(mnt)
    (entry / "comm").write_text(comm + "\n")
    (entry / "stat").write_text(f"{pid} ({comm}) S {parent} 1 1 0 -1\n")
    (entry / "cgroup").write_text(cgroup)


def engine_tree(proc: Path, where: str, cgroup_line: str = V1_CGROUP) -> None:
    """dockerd (100) -> containerd (101) -> shim (102) -> a container's init (103, its own
    cgroup); an unrelated process (200) beside dockerd; a lab's dockerd (300) in a network
    namespace of its own; a sandbox's process that named itself dockerd (400), in the host's
    network namespace (as a shared-network sandbox would be) but its own mount namespace."""
    proc.mkdir()
    fake_process(proc, "self", "pytest", 1, cgroup_line.format("/"))
    fake_process(proc, 1, "init", 0, cgroup_line.format("/"))
    fake_process(proc, 100, "dockerd", 1, cgroup_line.format(where))
    fake_process(proc, 101, "containerd", 100, cgroup_line.format(where))
    fake_process(proc, 102, "containerd-shim", 101, cgroup_line.format(where))
    fake_process(proc, 103, "python", 102, cgroup_line.format("/docker/" + "a" * 64))
    fake_process(proc, 200, "sshd", 1, cgroup_line.format(where))
    fake_process(proc, 300, "dockerd", 1, cgroup_line.format("/"), net=LAB_NET)
    fake_process(proc, 400, "dockerd", 102, cgroup_line.format("/"), mnt=SANDBOX_MNT)


def cgroup_tree(root: Path, version: str) -> None:
    if version == "v1":
        (root / "cpu").mkdir(parents=True)
    else:
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpu io memory pids\n")
        (root / "cgroup.subtree_control").write_text("memory pids\n")


def test_the_hosts_engine_and_its_helpers_move_but_not_containers_strangers_or_impostors(tmp_path: Path):
    proc = tmp_path / "proc"
    engine_tree(proc, "/")
    assert sorted(engine_pids(proc)) == [100, 101, 102]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_engine_gets_a_group_of_its_own_at_a_low_weight(tmp_path: Path, version: str):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    engine_tree(proc, "/", V1_CGROUP if version == "v1" else V2_CGROUP)
    cgroup_tree(root, version)
    said = place_engine(root, proc)
    assert "3 processes" in said and ENGINE.name in said
    directory, weight_file, weight = ENGINE.directory(root)
    assert (directory / weight_file).read_text() == weight == str(ENGINE.v1_shares if version == "v1" else 12)
    assert (directory / "cgroup.procs").exists()  # a plain file here: the last pid written stands for the move
    if version == "v2":
        assert (root / "cgroup.subtree_control").read_text() == "+cpu"


def test_an_engine_a_service_manager_placed_is_left_to_it(tmp_path: Path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    engine_tree(proc, "/system.slice/docker.service")
    cgroup_tree(root, "v1")
    said = place_engine(root, proc)
    assert "/system.slice/docker.service" in said and ENGINE.manager_hint in said
    assert not (root / "cpu" / ENGINE.name).exists()
    weighed, where, fix = engine_placement(root, proc)
    assert not weighed and fix == ENGINE.manager_hint and "service manager" in where


@pytest.mark.skipif(os.geteuid() != 0, reason="only root moves a process between CPU groups")
def test_a_gateway_a_service_manager_placed_is_left_to_it(tmp_path: Path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    fake_process(proc, 500, "sandkernel", 1, V1_CGROUP.format("/system.slice/sandkernel.service"))
    cgroup_tree(root, "v1")
    said = place_gateway(500, root, proc)
    assert GATEWAY.manager_hint in said and not (root / "cpu" / GATEWAY.name).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root moves a thread between CPU groups")
@pytest.mark.parametrize(("version", "where"), [("v1", f"/{GATEWAY.name}"), ("v2", f"/{GATEWAY.name}"), ("v1", "/")])
def test_a_gateways_bulk_thread_moves_to_a_tenants_weight_under_v1_only(tmp_path: Path, version: str, where: str):
    """Only a gateway that placed itself, under cgroup v1 (v2 keeps a process's threads in one
    domain), moves a bulk thread; a test's in-process gateway (here: the root group) does not."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    fake_process(proc, os.getpid(), "python", 1, (V1_CGROUP if version == "v1" else V2_CGROUP).format(where))
    cgroup_tree(root, version)
    said = place_bulk_thread(root, proc)
    directory, weight_file, weight = GATEWAY_BULK.directory(root)
    if version == "v1" and where == f"/{GATEWAY.name}":
        assert said is None
        assert (directory / weight_file).read_text() == weight == "1024"
        assert (directory / "tasks").read_text() == str(threading.get_native_id())  # this thread alone
    else:
        assert said and not directory.exists(), said


@pytest.mark.skipif(os.geteuid() != 0, reason="host-setup.sh places the engine only as root")
def test_on_this_host_the_engine_runs_at_its_low_weight():
    weighed, where, fix = engine_placement()
    if fix == ENGINE.manager_hint:
        pytest.skip(f"{where}: weighed by the service manager ({fix})")
    assert weighed, f"{where}; fix: {fix}"


@pytest.mark.docker
@pytest.mark.skipif(os.geteuid() != 0, reason="only root moves a process between CPU groups")
def test_sandkernel_serve_runs_in_the_gateways_group_at_its_weight(tmp_path: Path):
    """A real ``sandkernel serve``: started from this process's CPU group, it moves to the
    gateway's group (unless this process is in a manager's group: then it stays there); a
    resume's bulk file work runs in threads at a tenant's weight (under cgroup v1)."""
    mine = cpu_cgroup(os.getpid())
    port, token = free_port(), new_token()
    command = [sys.executable, "-m", "sandkernel.cli", "serve", "--port", str(port), f"--token={token}"]
    command += ["--state-dir", str(tmp_path / "state"), "--notebook-dir", str(tmp_path / "nb"), "--pool-size", "0"]
    command += ["--default-runtime", "runc"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_SECONDS
        while b"sandkernel gateway at" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        where = cpu_cgroup(proc.pid)
        session = call(port, token, "POST", "/api/sessions", {})
        call(port, token, "POST", f"/api/sessions/{session['id']}/pause")
        call(port, token, "POST", f"/api/sessions/{session['id']}/resume")  # deletes the snapshot in a bulk thread
        snapshots, deadline = tmp_path / "state" / "snapshots", time.monotonic() + START_SECONDS
        while any(entry.name.startswith(TRASH_PREFIX) for entry in snapshots.iterdir()):  # after the answer
            assert time.monotonic() < deadline, "the used snapshot was not deleted"
            time.sleep(0.05)
        threads = {
            cpu_cgroup(int(tid.name), proc_dir)
            for proc_dir in [Path(f"/proc/{proc.pid}/task")]
            for tid in proc_dir.iterdir()
        }
        call(port, token, "DELETE", f"/api/sessions/{session['id']}")
    finally:
        proc.terminate()
        proc.wait(START_SECONDS)
    if mine not in ("/", f"/{GATEWAY.name}"):
        assert where == mine and threads == {mine}, log.read_text()
        return
    assert where == f"/{GATEWAY.name}", log.read_text()
    directory, weight_file, weight = GATEWAY.directory(Path("/sys/fs/cgroup"))
    assert (directory / weight_file).read_text().strip() == weight
    if (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():  # v2: one domain for all threads
        assert threads == {where}, threads
    else:
        assert threads == {where, f"/{GATEWAY_BULK.name}"}, threads


def call(port: int, token: str, method: str, path: str, body: dict | None = None) -> dict:
    """One request to the gateway; its JSON answer ({} for none); an error status fails the test."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    request.add_header("Authorization", f"token {token}")
    with urllib.request.urlopen(request, timeout=START_SECONDS) as answer:
        raw = answer.read()
    return json.loads(raw) if raw else {}
