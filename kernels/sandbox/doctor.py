"""``sandkernel doctor``: is this machine ready to run sandboxed kernels, and if not, what to do.

Each check returns a :class:`Check` with a one-line finding and, when it fails, the fix.
Runtimes are checked for real (a throwaway container under each), because a runtime that is
registered but broken (gVisor's KVM platform, say) is the failure users actually meet.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import docker.errors

from sandkernel.errors import SandkernelError
from sandkernel.kernels.model.profiles import WorkspaceStorage, resolve_profile
from sandkernel.kernels.sandbox.container import SANDBOX_GID
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.memory_checkpoint import RESTORE_DIR
from sandkernel.kernels.sandbox.runtime_dir import RuntimeDir
from sandkernel.kernels.sandbox.service_cpu import engine_placement
from sandkernel.kernels.sandbox.workspace_disk import WorkspaceDisk, disk_support


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _check_runtime(engine: DockerEngine, runtime: str, image: str, required: bool) -> Check:
    if runtime not in engine.runtimes_sync():
        fix = "apt-get install runsc && bash scripts/host-setup.sh" if runtime == "runsc" else "reinstall docker.io"
        return Check(f"runtime {runtime}", False, "not registered with Docker", fix, required)
    try:
        engine.client.containers.run(
            image,
            ["true"],
            entrypoint=[],
            runtime=runtime,
            network_mode="none",
            remove=True,
            labels={"sandkernel.doctor": "1"},
        )
    except docker.errors.DockerException as err:
        return Check(
            f"runtime {runtime}", False, f"registered but a container failed: {err}", "see dockerd's log", required
        )
    return Check(f"runtime {runtime}", True, "registered and runs a container")


# Upstream releases that fixed container escapes (or, for Docker, the last supported line).
# A distribution build (a version such as 1.1.5+ds1-1+deb12u1) may carry the fixes as backports:
# the warning says so and points at the distribution's security tracker instead of guessing.
RUNC_ESCAPES: tuple[tuple[tuple[int, ...], str], ...] = (
    ((1, 1, 12), "CVE-2024-21626 (leaked fd: a container process reaches the host filesystem)"),
    ((1, 2, 8), "CVE-2025-31133, CVE-2025-52565, CVE-2025-52881 (masked paths and /proc writes redirected)"),
)
DOCKER_SUPPORTED_FROM = (25, 0)  # older engines get no upstream security fixes
RUNSC_MAX_AGE_DAYS = 365  # gVisor ships fixes in weekly releases; a year-old build misses many


def _version_tuple(text: str) -> tuple[int, ...]:
    match = re.search(r"(\d+(?:\.\d+)+)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def version_advisories(
    runc: str | None, runsc: str | None, docker: str | None, today: dt.date | None = None
) -> list[Check]:
    """Warnings (never failures) for runtimes and engines with known escapes or no support.

    Inputs are the first line each tool prints for ``--version`` (``runc version 1.1.5+ds1``,
    ``runsc version 0.0~20221219.0``) and Docker's ``Version``. Pure, so it is unit-tested."""
    today = today or dt.date.today()
    found: list[Check] = []
    distro_note = "; a distribution build may carry backported fixes: check its security tracker"
    if runc:
        version = _version_tuple(runc)
        missing = [cves for fixed, cves in RUNC_ESCAPES if version and version < fixed]
        if missing:
            distro = "+" in runc or "~" in runc
            found.append(
                Check(
                    "runc version",
                    False,
                    f"{runc.strip()} predates fixes for {'; '.join(missing)}" + (distro_note if distro else ""),
                    "upgrade runc (or use runsc, gVisor, for every session: sandkernel serve --default-runtime runsc)",
                    required=False,
                )
            )
    if runsc:
        stamp = re.search(r"(\d{8})", runsc)
        if stamp:
            built = dt.datetime.strptime(stamp.group(1), "%Y%m%d").date()
            age = (today - built).days
            if age > RUNSC_MAX_AGE_DAYS:
                found.append(
                    Check(
                        "runsc version",
                        False,
                        f"{runsc.strip()} is a gVisor release of {built.isoformat()}, {age} days old"
                        + (distro_note if "~" in runsc else ""),
                        "install a current gVisor release (https://gvisor.dev/docs/user_guide/install/)",
                        required=False,
                    )
                )
    if docker:
        version = _version_tuple(docker)
        if version and version[:2] < DOCKER_SUPPORTED_FROM:
            found.append(
                Check(
                    "docker version",
                    False,
                    f"Docker Engine {docker} is past its end of life: no upstream security fixes" + distro_note,
                    "upgrade to a supported Docker Engine",
                    required=False,
                )
            )
    return found


def _runtime_versions(engine: DockerEngine) -> tuple[str | None, str | None]:
    """The first line of ``runc --version`` and ``runsc --version`` as Docker runs them."""
    registered = _registered_runtimes(engine)
    return _runtime_version(registered, "runc"), _runtime_version(registered, "runsc")


def _registered_runtimes(engine: DockerEngine) -> dict:
    """Docker's runtime table (``docker info``'s Runtimes: name -> {"path": ...})."""
    return engine.client.info().get("Runtimes") or {}


def _runtime_version(registered: dict, name: str) -> str | None:
    """The first line of the runtime's ``--version``, run as Docker names it; None without one."""
    path = (registered.get(name) or {}).get("path") or shutil.which(name)
    binary = shutil.which(path) if path else None
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.splitlines() or [None])[0]


# The first gVisor build that saves and restores a sandbox here (Debian bookworm-backports').
MEMORY_SNAPSHOT_RUNSC = 20240729


def memory_snapshot_check(runsc: str | None, restores_in_place: bool) -> Check:
    """Whether savable gVisor sandboxes can work here: a runsc of MEMORY_SNAPSHOT_RUNSC or later,
    run by Docker through sandkernel's wrapper (scripts/sandkernel-runsc), which restores a memory
    image where it lies. Pure, unit-tested."""
    name, fix = "memory snapshots", "bash scripts/host-setup.sh (as root: runsc from bookworm-backports, its wrapper)"
    stamp = re.search(r"(\d{8})", runsc or "")
    if stamp is None or int(stamp.group(1)) < MEMORY_SNAPSHOT_RUNSC:
        found = runsc.strip() if runsc else "no runsc"
        return Check(name, False, f"need gVisor {MEMORY_SNAPSHOT_RUNSC} or later, found {found}", fix, required=False)
    if not restores_in_place:
        why = "Docker's runsc runtime is not sandkernel's wrapper (it cannot start a sandbox from a memory image)"
        return Check(name, False, why, fix, required=False)
    return Check(name, True, f"gVisor {stamp.group(1)}, through sandkernel's wrapper", required=False)


def memory_snapshots_unavailable(engine: DockerEngine | None = None) -> str | None:
    """Why savable gVisor sandboxes cannot work on this host (memory_snapshot_check's finding and
    its fix, or why Docker could not be asked), or None when they can. Blocking: one ``docker
    info`` and ``runsc --version`` (every gateway start asks: --memory-snapshots auto)."""
    try:
        registered = _registered_runtimes(engine or default_engine())
    except (SandkernelError, docker.errors.DockerException) as err:
        return f"Docker's runtimes could not be read: {err}"
    check = memory_snapshot_check(_runtime_version(registered, "runsc"), _wrapper_registered(registered))
    return None if check.ok else f"{check.detail} (fix: {check.fix})"


def runsc_restores_in_place(engine: DockerEngine) -> bool:
    """Whether the runtime Docker runs as ``runsc`` is sandkernel's wrapper (see _wrapper_registered)."""
    return _wrapper_registered(_registered_runtimes(engine))


def _wrapper_registered(registered: dict) -> bool:
    """Whether Docker's ``runsc`` runtime is sandkernel's wrapper: it names the same RESTORE_DIR as
    memory_checkpoint.py (the wrapper is a root-owned shell script)."""
    path = (registered.get("runsc") or {}).get("path")
    binary = shutil.which(path) if path else None
    try:
        return binary is not None and f"RESTORE_DIR={RESTORE_DIR}\n" in Path(binary).read_text(errors="replace")
    except OSError:
        return False


def _check_workspace_disk() -> Check:
    """Disk workspaces for real: make, mount and remove a small image under the state dir.
    Required when the default profile uses them (else sessions could not start by default)."""
    required = resolve_profile().workspace_storage is WorkspaceStorage.DISK
    fix = 'run the gateway as root, or set workspace_storage "memory" in the profiles file'
    supported, why = disk_support()
    if not supported:
        return Check("disk workspaces", False, why, fix, required)
    try:
        WorkspaceDisk.create(secrets.token_hex(16), 8, 0, SANDBOX_GID).remove()
    except (SandkernelError, OSError) as err:
        return Check("disk workspaces", False, f"a test image could not be made and mounted: {err}", fix, required)
    return Check("disk workspaces", True, why, required=required)


def run_checks(engine: DockerEngine | None = None) -> list[Check]:
    """All checks, in the order a person would fix them. Blocking."""
    engine = engine or default_engine()
    checks: list[Check] = []
    try:
        version = engine.client.version()
    except SandkernelError as err:
        return [Check("docker engine", False, str(err), "bash scripts/host-setup.sh")]
    checks.append(Check("docker engine", True, f"Docker {version.get('Version')} (API {version.get('ApiVersion')})"))
    runc_version, runsc_version = _runtime_versions(engine)
    checks.extend(version_advisories(runc_version, runsc_version, version.get("Version")))
    checks.append(memory_snapshot_check(runsc_version, runsc_restores_in_place(engine)))
    image = resolve_profile().image
    try:
        image_id = engine.image_id_sync(image)
        checks.append(Check("kernel image", True, f"{image} ({image_id[7:19]})"))
        have_image = True
    except SandkernelError as err:
        checks.append(Check("kernel image", False, str(err), "sandkernel image build"))
        have_image = False
    if have_image:
        checks.append(_check_runtime(engine, "runc", image, required=True))
        checks.append(_check_runtime(engine, "runsc", image, required=False))
    try:
        RuntimeDir.create().remove()
        checks.append(Check("runtime dir", True, "socket directory can be created"))
    except (OSError, SandkernelError) as err:
        checks.append(Check("runtime dir", False, str(err), "set SANDKERNEL_RUNTIME_DIR to a short writable path"))
    checks.append(_check_workspace_disk())
    engine_weighed, where, fix = engine_placement()
    checks.append(Check("engine CPU weight", engine_weighed, where, fix, required=False))
    has_debootstrap = shutil.which("debootstrap") is not None
    checks.append(
        Check(
            "offline base",
            has_debootstrap,
            "debootstrap available" if has_debootstrap else "debootstrap missing (needed only without a registry)",
            "apt-get install debootstrap",
            required=False,
        )
    )
    return checks
