"""After the whole suite (scripts/test.sh): no sandbox may outlive it unseen.

A container's processes can outlive what Docker knows of it (an engine torn down under its
containers, a shim killed): the seventh session found 330 kernel processes (7.8 GiB) left in
tenants' CPU groups by the Swarm lab's engines, which Docker no longer listed, so neither the
reaper nor ``docker ps`` saw them. This looks where the kernel puts them instead: every cgroup
under a tenant's CPU group (kernels/sandbox/cpu_groups.py) is a container's, named by its id.

``python -m tests.leftovers`` prints what it found, ends those processes and removes the empty
groups, and exits 1 if anything was left (the suite then fails: a test or the product leaks).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from sandkernel.kernels.sandbox.cgroup import CGROUP_ROOT, TENANT_GROUPS


def tenant_groups(root: Path = CGROUP_ROOT) -> list[Path]:
    """Every tenant CPU group directory, in every hierarchy (v1) or the unified one (v2), under
    any parent (the main engine's ``/docker`` or an engine of its own)."""
    return sorted({*root.glob(f"*/{TENANT_GROUPS}"), *root.glob(f"*/*/{TENANT_GROUPS}")})


def known_containers() -> set[str]:
    found = subprocess.run(["docker", "ps", "-aq", "--no-trunc"], capture_output=True, text=True, timeout=60)
    return set(found.stdout.split())


def processes_in(group: Path) -> dict[str, set[int]]:
    """container id -> the processes of its cgroup, for each container cgroup in ``group``."""
    held: dict[str, set[int]] = {}
    for procs in group.glob("*/cgroup.procs"):
        with contextlib.suppress(OSError):
            pids = {int(p) for p in procs.read_text().split()}
            if pids:
                held[procs.parent.name] = pids
    return held


def main() -> int:
    known = known_containers()
    groups = tenant_groups()
    leaked: dict[str, set[int]] = {}
    for group in groups:
        for container, pids in processes_in(group).items():
            if container not in known:
                leaked.setdefault(container, set()).update(pids)
    for container, pids in sorted(leaked.items()):
        print(f"[leftovers] {len(pids)} process(es) of container {container[:12]}, which Docker does not know")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    live = [group for group in groups if processes_in(group)]
    for group in sorted(groups, key=lambda p: len(p.parts), reverse=True):
        for child in sorted(group.iterdir(), reverse=True):
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()  # a container's cgroup that its processes left
        with contextlib.suppress(OSError):
            group.rmdir()  # refused while a live container is in it
    if leaked:
        print(
            f"[leftovers] the suite left {len(leaked)} sandbox(es) running that Docker does not know", file=sys.stderr
        )
        return 1
    print(f"[leftovers] none; {len(live)} tenant CPU group(s) still in use by live containers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
