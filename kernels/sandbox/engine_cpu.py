"""Give the Docker engine (dockerd, its containerd, shims and runc) a low CPU weight of its own.

scripts/host-setup.sh runs ``python -m sandkernel.kernels.sandbox.engine_cpu`` as root once dockerd
runs; ``sandkernel doctor`` reports where the engine is (:func:`engine_placement`). Blocking sysfs
and procfs work of a few milliseconds.

Why (issue 30): a tenant that forks, pauses and floods file calls makes the engine work hard
(create, start, exec, remove), and the engine's threads sat in the root CPU group, each a full
share beside the tenants' groups. On a 2-core host that work took the cores from the other
tenants' kernels and from the gateway: another tenant's trivial execute went from 10 ms at p99
alone to 60-90 ms. Lifecycle work is batch work and an execute is interactive, so the engine
yields: in a group of its own at 1/8 of a default group's weight (it still gets that share of a
saturated host, so it is never starved; on an idle host the weight changes nothing). Measured
in bench/noisy_neighbour.py (bench/README.md).

What moves: each ``dockerd`` process, and its descendants still in its CPU cgroup (containerd,
the shims, a runc at work); not a container's processes, which are in their own cgroups. New
shims and runcs are forked by those, so they start in the engine's group. Only an engine in the
root CPU group (started by hand or by this script) or already in ours is moved: one that a
service manager placed (``/system.slice/docker.service``) is the manager's to weigh, and the
hint printed says how. Idempotent; prints what it did; never fails the set-up (exit 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sandkernel.kernels.sandbox.cgroup import CGROUP_ROOT

PROC = Path("/proc")
GROUP = "sandkernel-engine"
V1_SHARES = 128  # cgroup v1 cpu.shares: a default group has 1024
V2_WEIGHT = 12  # cgroup v2 cpu.weight: a default group has 100
SYSTEMD_HINT = (
    "systemctl set-property docker.service CPUWeight=12 && systemctl set-property containerd.service CPUWeight=12"
)


def cpu_cgroup(pid: int, proc: Path = PROC) -> str | None:
    """The process's CPU cgroup path (v1 ``cpu`` controller, else the v2 unified one), None if gone."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def children(proc: Path = PROC) -> dict[int, list[int]]:
    """Each process's children, by parent pid."""
    tree: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def engine_pids(proc: Path = PROC) -> list[int]:
    """dockerd's pids and their descendants that share its CPU cgroup (not containers)."""
    tree = children(proc)
    found: list[int] = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "dockerd":
                    found.append(int(entry.name))
            except OSError:
                continue
    moved: list[int] = []
    for root in found:
        home = cpu_cgroup(root, proc)
        stack = [root]
        while stack:
            pid = stack.pop()
            if cpu_cgroup(pid, proc) == home:
                moved.append(pid)
                stack.extend(tree.get(pid, []))
    return moved


def group_dir(cgroup_root: Path) -> tuple[Path, str, str]:
    """Where the group goes, its weight file and value: v1 (a ``cpu`` hierarchy) or v2."""
    if (cgroup_root / "cgroup.controllers").exists():
        return cgroup_root / GROUP, "cpu.weight", str(V2_WEIGHT)
    return cgroup_root / "cpu" / GROUP, "cpu.shares", str(V1_SHARES)


def place_engine(cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> str:
    """Move the engine into its group (made if need be); what was done, as a sentence."""
    pids = engine_pids(proc)
    if not pids:
        return "no dockerd is running: nothing to weigh"
    ours = {"/", f"/{GROUP}"}
    elsewhere = {cpu_cgroup(pid, proc) for pid in pids} - ours
    if elsewhere:
        return (
            f"dockerd runs in the CPU group {sorted(elsewhere)[0]} (a service manager's): give it a low CPU weight "
            f"there, e.g. {SYSTEMD_HINT}"
        )
    group, weight_file, weight = group_dir(cgroup_root)
    if weight_file == "cpu.weight":  # v2: the root must hand the cpu controller to its children
        control = cgroup_root / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
    group.mkdir(mode=0o755, exist_ok=True)
    (group / weight_file).write_text(weight)
    moved = 0
    for pid in pids:
        try:
            (group / "cgroup.procs").write_text(str(pid))
            moved += 1
        except ProcessLookupError:
            continue  # ended meanwhile (a runc that finished)
    return f"the Docker engine ({moved} processes) runs in the CPU group /{GROUP}, {weight_file} {weight}"


SETUP_FIX = "bash scripts/host-setup.sh (as root)"


def engine_placement(cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> tuple[bool, str, str]:
    """Whether the engine's CPU weight is below a default group's; where it is, as a sentence; the fix."""
    pids = engine_pids(proc)
    if not pids:
        return False, "no dockerd process found", SETUP_FIX
    where = cpu_cgroup(pids[0], proc)
    if where not in ("/", f"/{GROUP}"):
        return False, f"dockerd runs in the CPU group {where} (a service manager's)", SYSTEMD_HINT
    if where == "/":
        return (
            False,
            "dockerd runs in the root CPU group at a full share: lifecycle work competes with executes",
            SETUP_FIX,
        )
    group, weight_file, weight = group_dir(cgroup_root)
    try:
        now = (group / weight_file).read_text().strip()
    except OSError as err:
        return False, f"the engine's CPU group has no readable {weight_file} ({err})", SETUP_FIX
    return now == weight, f"dockerd runs in the CPU group /{GROUP}, {weight_file} {now} (wanted {weight})", SETUP_FIX


def main() -> int:
    if os.geteuid() != 0:
        print("not root: the Docker engine's CPU weight is left as it is")
        return 0
    try:
        print(place_engine())
    except OSError as err:
        print(
            f"WARNING: the Docker engine's CPU weight could not be set ({err}); executes may slow down while "
            "another tenant makes many sandboxes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
