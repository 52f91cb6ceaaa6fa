"""The package list, derived from the folders (everything else is in pyproject.toml).

The design card keeps the top-level folders (kernels/, gateway/, agent/, notebooks/,
kernel-image/) and maps each to a package of ``sandkernel``; setuptools cannot find packages
through such a mapping by itself, and a hand-kept list once left new sub-packages out of the
wheel. So the mapping is stated once, here, and every folder under it holding an
``__init__.py`` is a package (tests/test_packaging.py compares the wheel with the checkout).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent

# Package name -> folder. A folder mapped here is not also a sub-package of its parent's.
PACKAGE_DIRS = {
    "sandkernel": "sandkernel",
    "sandkernel.kernels": "kernels",
    "sandkernel.gateway": "gateway",
    "sandkernel.agent": "agent",
    # Framework integrations are client code: they live beside the client, under their own import path.
    "sandkernel.integrations": "agent/integrations",
    "sandkernel.notebooks": "notebooks",
    # The image's build files ship as package data so an installed wheel can build the image
    # (kernels/sandbox/image.py finds them); the folder stays at the top of the repository.
    "sandkernel.kernel_image": "kernel-image",
}


def packages() -> list[str]:
    """Every mapped package, and each folder below one that holds an ``__init__.py``."""
    mapped = {HERE / folder for folder in PACKAGE_DIRS.values()}
    found = []
    for name, folder in PACKAGE_DIRS.items():
        root = HERE / folder
        found.append(name)
        for init in sorted(root.rglob("__init__.py")):
            package_dir = init.parent
            if package_dir == root or "__pycache__" in package_dir.parts:
                continue
            if any(parent in mapped for parent in [package_dir, *package_dir.parents] if root in parent.parents):
                continue  # mapped to a name of its own (or below such a folder)
            found.append(".".join([name, *package_dir.relative_to(root).parts]))
    return found


setup(packages=packages(), package_dir=PACKAGE_DIRS)
