"""The ``swarm_lab`` pytest fixture: a throwaway three-host Docker Swarm for a test module.

Use it with ``from .cluster.fixtures import swarm_lab_fixture  # noqa: F401`` in a test module
(registered under the name ``swarm_lab``, so the tests' argument is no redefinition for ruff), or once
in tests/conftest.py. Module scope on purpose: two modules never hold two labs at once (they
would fight over the same namespaces, addresses and names), each module starts from a clean
swarm, and the teardown at the end of every module checks that nothing of the lab is left
(LabError otherwise, reported as an error of the module's last test). A module tunes its lab
with a module-level ``SWARM_LAB = {...}`` of :class:`~tests.cluster.lab.Lab` keyword arguments
(e.g. ``{"runsc_hosts": (1, 2), "images": (BASE_IMAGE, KERNEL_IMAGE)}``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .lab import Lab, running_lab


@pytest.fixture(scope="module", name="swarm_lab")
def swarm_lab_fixture(request: pytest.FixtureRequest) -> Iterator[Lab]:
    """A :class:`Lab` that is up for the module (3 Ready nodes, images loaded), torn down after it."""
    with running_lab(**getattr(request.module, "SWARM_LAB", {})) as lab:
        yield lab
