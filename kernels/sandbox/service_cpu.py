"""CPU weights of the host's two services: the Docker engine low, the gateway high.

Why (issue 30): on a saturated host every runnable thread waits for a core, and an execute is a
chain of wake-ups (the gateway's loop, its ZMQ thread, the kernel's threads, back). A tenant that
forks, pauses and floods file calls makes the engine (dockerd, containerd, shims, runc) and the
gateway work hard, and both sat in the root CPU group, each engine thread a full share beside
the tenants' groups. On a 2-core host another tenant's trivial execute went from 10 ms at p99
alone to 60-90 ms (runc). Lifecycle work is batch work and the gateway carries every tenant's
interactive calls, so:

- the engine runs in ``sandkernel-engine`` at 1/8 of a default group's weight: it still gets that
  share of a saturated host, so it is never starved, and on an idle host the weight changes
  nothing. scripts/host-setup.sh places it (``python -m sandkernel.kernels.sandbox.service_cpu``),
  ``sandkernel doctor`` reports it (:func:`engine_placement`);
- the gateway runs in ``sandkernel-gateway`` at 8 times a default group's weight: ``sandkernel
  serve`` places itself at start (:func:`place_gateway`). Its children (mount, runsc checkpoint)
  inherit it; its work is everyone's, so it outranks any one tenant's group;
- but its bulk file work (a snapshot's hashes and copies: kernels/sandbox/bulk_io.py) is done for
  one tenant at a time, seconds of CPU per call: its threads run in ``sandkernel-gateway-bulk``,
  at a tenant's weight (:func:`place_bulk_thread`). At the gateway's weight, one tenant's two
  hashing threads took both cores from another tenant's kernel (bench/noisy_neighbour.py, gVisor,
  pauses of large workspaces: that tenant's p99 2.25-2.67x its p99 alone, against 1.53-1.87x in
  the group). cgroup v1 only: v2 keeps all threads of a process in one domain, so there they stay
  with the gateway's.

Measured in bench/noisy_neighbour.py (bench/README.md). Only a process in the root CPU group
(started by hand or by a script) or already in ours is moved: one that a service manager placed
(``/system.slice/docker.service``) is the manager's to weigh, and the hint says how. Under cgroup
v2 a move changes every controller, so the rule also keeps a service inside the memory limits a
manager gave it. Blocking sysfs and procfs work of a few milliseconds.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from sandkernel.kernels.sandbox.cgroup import CGROUP_ROOT

PROC = Path("/proc")
SETUP_FIX = "bash scripts/host-setup.sh (as root)"


@dataclass(frozen=True)
class ServiceGroup:
    """A CPU group for one host service: its name and weight (v1 ``cpu.shares`` of a default 1024,
    v2 ``cpu.weight`` of a default 100), and what to tell an operator whose manager placed it."""

    name: str
    v1_shares: int
    v2_weight: int
    manager_hint: str

    def directory(self, cgroup_root: Path) -> tuple[Path, str, str]:
        """Where the group is, its weight file and value: v1 (a ``cpu`` hierarchy) or v2."""
        if (cgroup_root / "cgroup.controllers").exists():
            return cgroup_root / self.name, "cpu.weight", str(self.v2_weight)
        return cgroup_root / "cpu" / self.name, "cpu.shares", str(self.v1_shares)


ENGINE = ServiceGroup(
    "sandkernel-engine",
    128,
    12,
    "systemctl set-property docker.service CPUWeight=12 && systemctl set-property containerd.service CPUWeight=12",
)
GATEWAY = ServiceGroup("sandkernel-gateway", 8192, 800, "set CPUWeight=800 in the gateway's service unit")
# A tenant's weight: Docker makes the tenants' groups (cpu_groups.py) at the default one.
GATEWAY_BULK = ServiceGroup("sandkernel-gateway-bulk", 1024, 100, "a service manager's gateway keeps its bulk threads")


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


def namespaces(entry: Path) -> tuple[str, str] | None:
    """The network and mount namespaces a /proc entry's process is in (``net:[inode]``,
    ``mnt:[inode]``), None if gone. A sandbox's processes are never in the host's: what a tenant
    names a process (its ``comm`` is the tenant's to set) cannot pass for the host's dockerd."""
    try:
        return os.readlink(entry / "ns" / "net"), os.readlink(entry / "ns" / "mnt")
    except OSError:
        return None


def engine_pids(proc: Path = PROC) -> list[int]:
    """This host's dockerd (the one in this process's network and mount namespaces: not an engine a
    test lab runs in namespaces of its own, nor a sandbox's process named ``dockerd``) and its
    descendants that share its CPU cgroup and namespaces (containerd, the shims, a runc at work;
    not containers, which are in cgroups and namespaces of their own)."""
    tree = children(proc)
    ours = namespaces(proc / "self")
    found: list[int] = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "dockerd" and namespaces(entry) == ours:
                    found.append(int(entry.name))
            except OSError:
                continue
    moved: list[int] = []
    for root in found:
        home = cpu_cgroup(root, proc)
        stack = [root]
        while stack:
            pid = stack.pop()
            if cpu_cgroup(pid, proc) == home and namespaces(proc / str(pid)) == ours:
                moved.append(pid)
                stack.extend(tree.get(pid, []))
    return moved


def place(group: ServiceGroup, pids: list[int], what: str, cgroup_root: Path, proc: Path) -> str:
    """Move ``pids`` (whole processes) into ``group``, made and weighed if need be, unless a
    manager placed them; what was done, as a sentence naming ``what``."""
    if not pids:
        return f"no {what} is running: nothing to weigh"
    elsewhere = {cpu_cgroup(pid, proc) for pid in pids} - {"/", f"/{group.name}"}
    if elsewhere:
        return f"{what} runs in the CPU group {sorted(elsewhere)[0]} (a service manager's): {group.manager_hint}"
    directory, weight_file, weight = group.directory(cgroup_root)
    if weight_file == "cpu.weight":  # v2: the root must hand the cpu controller to its children
        control = cgroup_root / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
    directory.mkdir(mode=0o755, exist_ok=True)
    (directory / weight_file).write_text(weight)
    moved = 0
    for pid in pids:
        try:
            (directory / "cgroup.procs").write_text(str(pid))
            moved += 1
        except ProcessLookupError:
            continue  # ended meanwhile (a runc that finished)
    return f"{what} ({moved} processes) runs in the CPU group /{group.name}, {weight_file} {weight}"


def place_engine(cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> str:
    """Move the Docker engine into :data:`ENGINE`; what was done."""
    return place(ENGINE, engine_pids(proc), "the Docker engine", cgroup_root, proc)


def place_gateway(pid: int | None = None, cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> str:
    """Move the gateway's process (this one) into :data:`GATEWAY`, as root only; what was done."""
    if os.geteuid() != 0:
        return "not root: the gateway's CPU weight is left as it is"
    try:
        return place(GATEWAY, [pid or os.getpid()], "the gateway", cgroup_root, proc)
    except OSError as err:
        return f"the gateway's CPU weight could not be set ({err})"


def place_bulk_thread(cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> str | None:
    """Move the calling thread into :data:`GATEWAY_BULK` (made and weighed if need be) when this
    process is a gateway that placed itself in :data:`GATEWAY` under cgroup v1; None once moved,
    else why not (a gateway a manager placed, or in a test's process, keeps its threads together)."""
    if (cgroup_root / "cgroup.controllers").exists():
        return "cgroup v2 keeps a process's threads in one domain"
    if os.geteuid() != 0 or cpu_cgroup(os.getpid(), proc) != f"/{GATEWAY.name}":
        return f"this process is not a gateway in /{GATEWAY.name}"
    directory, weight_file, weight = GATEWAY_BULK.directory(cgroup_root)
    directory.mkdir(mode=0o755, exist_ok=True)
    (directory / weight_file).write_text(weight)
    (directory / "tasks").write_text(str(threading.get_native_id()))
    return None


def engine_placement(cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> tuple[bool, str, str]:
    """Whether the engine's CPU weight is :data:`ENGINE`'s; where it is, as a sentence; the fix."""
    pids = engine_pids(proc)
    if not pids:
        return False, "no dockerd process found", SETUP_FIX
    where = cpu_cgroup(pids[0], proc)
    if where not in ("/", f"/{ENGINE.name}"):
        return False, f"dockerd runs in the CPU group {where} (a service manager's)", ENGINE.manager_hint
    if where == "/":
        return (
            False,
            "dockerd runs in the root CPU group at a full share: lifecycle work competes with executes",
            SETUP_FIX,
        )
    directory, weight_file, weight = ENGINE.directory(cgroup_root)
    try:
        now = (directory / weight_file).read_text().strip()
    except OSError as err:
        return False, f"the engine's CPU group has no readable {weight_file} ({err})", SETUP_FIX
    return (
        now == weight,
        f"dockerd runs in the CPU group /{ENGINE.name}, {weight_file} {now} (wanted {weight})",
        SETUP_FIX,
    )


def main() -> int:
    """host-setup.sh's step: place the engine; never fails the set-up."""
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
