"""The Docker engine's cgroup parent (dockerd's ``--cgroup-parent``) decides where the tenants'
CPU groups go and where sandboxes' cgroups are found: a group made under ``/docker`` on an engine
whose containers live under ``/sklab-h1`` put sandboxes outside what the operator gave the engine
(and outside the Swarm lab's teardown, which ends every process under its hosts' cgroups, so they
outlived it). End to end on real engines with their own parent: tests/test_cluster_swarm.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sandkernel.errors import ConfigError
from sandkernel.gateway.settings import GatewaySettings
from sandkernel.kernels.sandbox.cgroup import (
    DEFAULT_ENGINE_PARENT,
    CgroupV1,
    engine_parent,
    locate,
    use_engine_parent,
)
from sandkernel.kernels.sandbox.cpu_groups import cgroup_parent, group_for, group_of, remove_empty_groups

CONTAINER = "ab" * 32


@pytest.fixture
def lab_engine_parent() -> Iterator[str]:
    previous = use_engine_parent("/sklab-h1")
    try:
        yield "/sklab-h1"
    finally:
        use_engine_parent(previous)


def v1_container(root: Path, tail: str) -> None:
    """The two files :func:`locate` checks for a v1 container cgroup, at ``tail``."""
    (root / "cpuacct" / tail).mkdir(parents=True)
    (root / "cpuacct" / tail / "cpuacct.usage").write_text("0\n")
    (root / "memory" / tail).mkdir(parents=True)
    (root / "memory" / tail / "memory.max_usage_in_bytes").write_text("0\n")


def test_groups_go_under_the_engines_parent_and_are_recognised_only_there(lab_engine_parent: str):
    group = group_for("alice")
    assert cgroup_parent(group, "cgroupfs") == f"{lab_engine_parent}/{group}"
    assert group_of(f"{lab_engine_parent}/{group}") == group
    assert group_of(f"/docker/{group}") is None  # not where this engine's groups are
    assert cgroup_parent(group, "systemd") is None
    use_engine_parent(DEFAULT_ENGINE_PARENT)
    # Docker's default parent: the groups are at the top, beside /docker (not under it), and a
    # group an earlier gateway made under /docker is still known (its sandboxes are adopted).
    assert cgroup_parent(group, "cgroupfs") == f"/{group}"
    assert group_of(f"/{group}") == group and group_of(f"/docker/{group}") == group
    assert group_of(f"/elsewhere/{group}") is None and group_of(f"/{group}-x") is None


def test_with_dockers_default_parent_sandboxes_and_groups_are_found_at_the_top_and_under_docker(tmp_path: Path):
    group = group_for("alice")
    v1_container(tmp_path, f"{group}/{CONTAINER}")
    found = locate(CONTAINER, tmp_path)
    assert isinstance(found, CgroupV1) and found.cpuacct == tmp_path / "cpuacct" / group / CONTAINER
    v1_container(tmp_path, f"docker/{group}/{'cd' * 32}")  # an earlier gateway's sandbox
    assert locate("cd" * 32, tmp_path) is not None
    for tail in (f"{group}/{CONTAINER}", f"docker/{group}/{'cd' * 32}"):  # both sandboxes went
        for controller in ("cpuacct", "memory"):
            for file in (tmp_path / controller / tail).iterdir():
                file.unlink()
            (tmp_path / controller / tail).rmdir()
    assert remove_empty_groups([group], tmp_path) == 4
    assert not list(tmp_path.glob(f"**/{group}"))


def test_sandboxes_and_empty_groups_are_found_under_the_engines_parent(tmp_path: Path, lab_engine_parent: str):
    group = group_for("alice")
    v1_container(tmp_path, f"sklab-h1/{group}/{CONTAINER}")
    found = locate(CONTAINER, tmp_path)
    assert isinstance(found, CgroupV1) and found.cpuacct == tmp_path / "cpuacct" / "sklab-h1" / group / CONTAINER
    v1_container(tmp_path, f"sklab-h1/{'cd' * 32}")
    assert locate("cd" * 32, tmp_path) is not None  # ungrouped: the engine's own place
    use_engine_parent(DEFAULT_ENGINE_PARENT)
    assert locate(CONTAINER, tmp_path) is None
    use_engine_parent(lab_engine_parent)

    for controller in ("cpuacct", "memory"):  # the sandbox went: its group is empty now
        (tmp_path / controller / "sklab-h1" / group / CONTAINER / "cpuacct.usage").unlink(missing_ok=True)
        (tmp_path / controller / "sklab-h1" / group / CONTAINER / "memory.max_usage_in_bytes").unlink(missing_ok=True)
        (tmp_path / controller / "sklab-h1" / group / CONTAINER).rmdir()
    assert remove_empty_groups([group], tmp_path) == 2
    assert not (tmp_path / "cpuacct" / "sklab-h1" / group).exists()


@pytest.mark.parametrize("parent", ["docker", "/", "", "/a/../b", "/a/./b", "/a//b", "/a b", "/docker/"])
def test_an_engine_parent_that_is_not_a_plain_absolute_cgroup_path_is_refused(parent: str):
    with pytest.raises(ValueError, match="absolute cgroup path"):
        use_engine_parent(parent)
    assert engine_parent() == DEFAULT_ENGINE_PARENT
    with pytest.raises(ConfigError, match="docker_cgroup_parent"):
        GatewaySettings.from_sources({"docker_cgroup_parent": parent}, environ={})


def test_the_setting_defaults_to_dockers_default_and_reads_the_environment():
    assert GatewaySettings.from_sources({}, environ={}).docker_cgroup_parent == DEFAULT_ENGINE_PARENT
    settings = GatewaySettings.from_sources({}, environ={"SANDKERNEL_DOCKER_CGROUP_PARENT": "/sklab-h2"})
    assert settings.docker_cgroup_parent == "/sklab-h2"
