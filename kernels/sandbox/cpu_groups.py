"""Tenants' CPU groups: all the sandboxes of one tenant in one cgroup, so that a busy host's CPU
is shared by tenant, not by sandbox.

Why: Docker gives every container the same ``cpu.shares`` side by side under ``/docker``, so a
tenant with seven sandboxes starting, packing and unpacking held seven shares of a saturated host
and another tenant's one kernel held one: issue 30's noisy-neighbour bench measured that other
tenant's trivial execute at 2.5x its p50 and 15x its p99. With a group per tenant each tenant is
one entity of equal weight whatever its number of sandboxes, and a kernel that wakes in a group
that used little CPU runs first; each sandbox's own limits (``cpus``, memory, pids) still apply
inside its group. The groups are at the top of the hierarchy (cgroup parent
``/sandkernel-tenant-<digest>``; inside the engine's parent when the operator gave dockerd one:
cgroup.tenant_groups_parent), not under a shared ``/docker``: there a quiet tenant's kernel that
woke was queued behind ``/docker`` as a whole whenever a busy tenant kept it running (measured,
gVisor: another tenant's p99 under the noise fell from 134 to 98 ms once it had its own place).

A group is named after a digest of the gateway's state directory and the tenant's name (never
the name itself, which is whatever the operator's tokens file holds): a gateway restarted on the
same state directory puts new sandboxes beside the ones it adopted, and two gateways of one host
never share a group. Docker makes a group with the first container in it and leaves it when the
last one goes: the gateway removes the empty ones it used when it stops (:func:`remove_empty_groups`;
no other gateway uses them, so none is starting a container in one meanwhile).

Only Docker's ``cgroupfs`` driver is supported: under the ``systemd`` driver a parent must be a
slice that systemd manages, so sandboxes are not grouped there (logged once) and share the CPU
by sandbox, as before. Pooled sandboxes start before anyone owns them and stay in Docker's
default place when a tenant takes one; a replacement container joins the tenant's group.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from sandkernel.kernels.sandbox.cgroup import CGROUP_ROOT, TENANT_GROUPS, tenant_group_parents, tenant_groups_parent
from sandkernel.kernels.sandbox.state_dir import state_dir

log = logging.getLogger(__name__)

GROUP_PREFIX = TENANT_GROUPS.rstrip("*")
GROUP_NAME = re.compile(GROUP_PREFIX + r"[0-9a-f]{16}")
CGROUPFS_DRIVER = "cgroupfs"
_warned_drivers: set[str] = set()


def group_for(tenant: str) -> str:
    """The CPU group of ``tenant``'s sandboxes under this gateway's state directory."""
    scope = f"{state_dir()}\0{tenant}".encode()
    return GROUP_PREFIX + hashlib.sha256(scope).hexdigest()[:16]


def cgroup_parent(group: str | None, driver: str) -> str | None:
    """Docker's ``cgroup_parent`` for a sandbox of ``group`` under the engine's cgroup ``driver``;
    None (Docker's default place) for no group, or for a driver groups are not made under."""
    if group is None:
        return None
    if not GROUP_NAME.fullmatch(group):
        raise ValueError(f"not a sandkernel CPU group: {group!r}")
    if driver != CGROUPFS_DRIVER:
        if driver not in _warned_drivers:
            _warned_drivers.add(driver)
            log.warning("Docker's cgroup driver is %r: sandboxes are not grouped by tenant for CPU", driver)
        return None
    return f"{tenant_groups_parent()}/{group}"


def group_of(parent: object) -> str | None:
    """The group a container's recorded ``HostConfig.CgroupParent`` names, if it is one of ours."""
    if not isinstance(parent, str):
        return None
    place, _, name = parent.rstrip("/").rpartition("/")
    return name if place.lstrip("/") in tenant_group_parents() and GROUP_NAME.fullmatch(name) else None


def remove_empty_groups(groups: Iterable[str], root: Path = CGROUP_ROOT) -> int:
    """Remove those of ``groups`` that no container is in (rmdir refuses a group that holds one,
    so a group in use is never touched), in every hierarchy (v1) or the unified one (v2).
    Blocking sysfs work: call it in a thread. Returns how many directories went."""
    removed = 0
    places = [Path(place) for place in tenant_group_parents()]
    for group in sorted(g for g in groups if GROUP_NAME.fullmatch(g)):
        paths = [root / place / group for place in places]
        paths += [path for place in places for path in root.glob(str(Path("*") / place / group))]
        for path in paths:
            try:
                os.rmdir(path)
            except OSError:
                continue  # in use (EBUSY), or not there
            removed += 1
    return removed
