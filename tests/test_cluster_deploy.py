"""The Swarm deployment's pieces that need no swarm: the stack file as shipped, the secrets'
checks, the launcher's reading of its own container, and `sandkernel cluster up` refusing an
engine that is not a Swarm manager. The deployment itself runs in tests/test_cluster_swarm.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandkernel.gateway.cluster.deploy import SECRET_NAMES, STACK_SERVICE, DeployError, SecretSource, stack_text
from sandkernel.gateway.cluster.launcher import (
    REQUIRED_SECRETS,
    SECRET_SETTINGS,
    LaunchError,
    own_container_id,
    read_secrets,
)

CONTAINER_ID = "0123456789abcdef" * 4


def test_the_stack_file_runs_one_launcher_per_node_with_its_secrets_readable_by_root_only():
    stack = yaml.safe_load(stack_text())
    service = stack["services"][STACK_SERVICE]
    assert service["deploy"]["mode"] == "global"
    assert service["command"][:2] == ["cluster", "launch"]
    assert service["deploy"]["update_config"]["order"] == "stop-first"  # two gateways never share a host id
    mounted = {s["target"]: s for s in service["secrets"]}
    assert set(mounted) == set(SECRET_SETTINGS)
    assert all(s["mode"] == 0o400 for s in mounted.values())  # the gateway refuses wider secret files
    assert {stack["secrets"][s["source"]]["name"] for s in mounted.values()} == set(SECRET_NAMES)
    assert "environment" not in service  # nothing secret in the environment
    assert service["volumes"] == [
        {"type": "bind", "source": "/var/run/docker.sock", "target": "/var/run/docker.sock"}
    ]  # the launcher holds the socket and nothing else of the host


def test_a_secret_file_readable_by_others_or_empty_is_refused(tmp_path: Path):
    loose = tmp_path / "catalog.url"
    loose.write_text("postgresql://u:p@db/x")
    loose.chmod(0o644)
    with pytest.raises(DeployError, match="chmod 600"):
        SecretSource("sandkernel_catalog_url", loose).read()
    empty = tmp_path / "tokens.json"
    empty.write_text("  \n")
    empty.chmod(0o600)
    with pytest.raises(DeployError, match="empty"):
        SecretSource("sandkernel_tokens", empty).read()
    with pytest.raises(DeployError, match="needs a file"):
        SecretSource("sandkernel_tokens", None).read()
    generated = SecretSource("sandkernel_cluster_secret", None, generate=True).read()
    assert len(generated) >= 32 and generated != SecretSource("sandkernel_cluster_secret", None, generate=True).read()


def test_the_launcher_refuses_to_start_without_the_required_secrets(tmp_path: Path):
    (tmp_path / "tokens").write_text("{}")
    with pytest.raises(LaunchError, match=", ".join(REQUIRED_SECRETS)):
        read_secrets(tmp_path)


def test_the_launcher_finds_its_container_from_the_files_docker_mounts_into_it():
    mountinfo = (
        "1 0 0:1 / / rw - overlay overlay rw\n"
        f"2 1 8:1 /var/lib/docker/containers/{CONTAINER_ID}/resolv.conf /etc/resolv.conf rw - ext4 /dev/sda1 rw\n"
        f"3 1 8:1 /var/lib/docker/containers/{CONTAINER_ID}/hostname /etc/hostname rw - ext4 /dev/sda1 rw\n"
    )
    assert own_container_id(mountinfo) == CONTAINER_ID
    assert own_container_id("1 0 0:1 / / rw - overlay overlay rw\n") is None  # not in a container
    assert own_container_id(f"2 1 8:1 /containers/{CONTAINER_ID[:12]}/hostname /etc/hostname rw\n") is None


def test_cluster_up_on_an_engine_that_is_not_a_swarm_manager_says_what_to_do(tmp_path: Path):
    url = tmp_path / "catalog.url"
    url.write_text("postgresql://u:p@127.0.0.1/x")
    url.chmod(0o600)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("sandkernel")), "cluster", "up", "--catalog-url-file", str(url)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "not a Swarm manager" in result.stdout and "docker swarm init" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
