"""The ``sandkernel-python`` kernelspecs, installable for any Jupyter tool and built in for ours.

``sandkernel-python`` runs under runc; ``sandkernel-python-gvisor`` under runsc. Both use
message-mode interrupts: the control channel reaches the kernel without a ``docker exec``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from sandkernel.kernels.sandbox.container import LAUNCHER

KERNEL_NAMES = {"sandkernel-python": "runc", "sandkernel-python-gvisor": "runsc"}


def kernel_name_for(runtime: str) -> str:
    """The kernelspec that runs under ``runtime`` ("runc" or "runsc", or a Runtime): the one
    place the mapping is read backwards."""
    value = getattr(runtime, "value", runtime)
    return next(name for name, candidate in KERNEL_NAMES.items() if candidate == value)


def kernel_json(name: str) -> dict:
    runtime = KERNEL_NAMES[name]
    label = "gVisor" if runtime == "runsc" else "Docker"
    return {
        "argv": [LAUNCHER, "{connection_file}"],
        "display_name": f"Python 3 (sandkernel, {label})",
        "language": "python",
        "interrupt_mode": "message",
        "env": {},
        "metadata": {
            "debugger": True,
            "kernel_provisioner": {
                "provisioner_name": "sandkernel-docker",
                "config": {"profile_name": "default", "runtime": runtime},
            },
        },
    }


def install_kernelspecs(user: bool = False, prefix: str | None = None) -> list[str]:
    """Install both kernelspecs with jupyter_client (system-wide, ``--user`` or ``--prefix``)."""
    manager = KernelSpecManager()
    installed = []
    for name in KERNEL_NAMES:
        with tempfile.TemporaryDirectory() as tmp:
            spec_dir = Path(tmp) / name
            spec_dir.mkdir()
            (spec_dir / "kernel.json").write_text(json.dumps(kernel_json(name), indent=2))
            installed.append(manager.install_kernel_spec(str(spec_dir), name, user=user, prefix=prefix))
    return installed


class SandkernelSpecManager(KernelSpecManager):
    """A KernelSpecManager that knows the sandkernel specs even when they are not installed,
    so the gateway and session layer never depend on a machine-wide install."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        if kernel_name in KERNEL_NAMES:
            return KernelSpec(resource_dir=str(Path(sys.prefix)), **kernel_json(kernel_name))
        raise NoSuchKernel(kernel_name)

    def find_kernel_specs(self) -> dict[str, str]:
        return {name: str(Path(sys.prefix)) for name in KERNEL_NAMES}

    def get_all_specs(self) -> dict[str, dict]:
        return {name: {"resource_dir": str(Path(sys.prefix)), "spec": kernel_json(name)} for name in KERNEL_NAMES}
