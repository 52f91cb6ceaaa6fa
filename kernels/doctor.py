"""``sandkernel doctor``: is this machine ready to run sandboxed kernels, and if not, what to do.

Each check returns a :class:`Check` with a one-line finding and, when it fails, the fix.
Runtimes are checked for real (a throwaway container under each), because a runtime that is
registered but broken (gVisor's KVM platform, say) is the failure users actually meet.
"""

from __future__ import annotations

import dataclasses
import shutil

import docker.errors

from sandkernel.errors import SandkernelError
from sandkernel.kernels.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.profiles import resolve_profile
from sandkernel.kernels.runtime_dir import RuntimeDir


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


def run_checks(engine: DockerEngine | None = None) -> list[Check]:
    """All checks, in the order a person would fix them. Blocking."""
    engine = engine or default_engine()
    checks: list[Check] = []
    try:
        version = engine.client.version()
    except SandkernelError as err:
        return [Check("docker engine", False, str(err), "bash scripts/host-setup.sh")]
    checks.append(Check("docker engine", True, f"Docker {version.get('Version')} (API {version.get('ApiVersion')})"))
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
