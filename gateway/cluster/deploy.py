"""The files a Swarm deployment is made of, as shipped with the package: the stack file.

One place for the stack file's text (package data next to the gateway image's Dockerfile), so
`sandkernel cluster stack`, `sandkernel cluster up` and the tests deploy the same file, and the
one way to bring a cluster up (:func:`bring_up`).
"""

from __future__ import annotations

import base64
import importlib.resources
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import docker

Progress = Callable[[str], None]

STACK_FILE = "stack.yml"
STACK_SERVICE = "gateway"  # the service's name inside the stack file
SECRET_NAMES = {  # the stack's external Docker secrets -> what each holds
    "sandkernel_catalog_url": "the postgresql:// URL of the cluster catalog (with its password)",
    "sandkernel_cluster_secret": "the secret the gateways sign forwarded requests with (32+ bytes)",
    "sandkernel_tokens": 'the tenants\' tokens file, JSON {"tenant": "token"}',
}


def stack_text() -> str:
    """The stack file for ``docker stack deploy`` (the gateway as a global service)."""
    return importlib.resources.files("sandkernel.gateway.cluster").joinpath("image", STACK_FILE).read_text()


class DeployError(Exception):
    """The stack cannot be deployed; the message says what to fix."""


@dataclass(frozen=True)
class SecretSource:
    """Where one of the stack's secrets comes from: a file the operator wrote (chmod 600), or
    generated here when the operator gave none and may (only the cluster secret)."""

    name: str
    path: Path | None
    generate: bool = False

    def read(self) -> bytes:
        if self.path is None:
            if not self.generate:
                raise DeployError(f"the secret {self.name} ({SECRET_NAMES[self.name]}) needs a file")
            return base64.b64encode(secrets.token_bytes(48))
        try:
            info = os.stat(self.path)
            data = self.path.read_bytes().strip()
        except OSError as err:
            raise DeployError(f"cannot read {self.path} for {self.name}: {err.strerror or err}") from None
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise DeployError(f"{self.path} ({SECRET_NAMES[self.name]}) is readable by others; chmod 600 {self.path}")
        if not data:
            raise DeployError(f"{self.path} is empty; it must hold {SECRET_NAMES[self.name]}")
        return data


def create_secrets(client: docker.DockerClient, sources: list[SecretSource], progress: Progress) -> None:
    """Create each secret the swarm does not have yet. An existing one is kept, never replaced:
    Docker secrets are immutable while a service uses them (rotate by a new name, see the docs)."""
    existing = {s.name for s in client.secrets.list()}
    for source in sources:
        if source.name in existing:
            progress(f"[secret] {source.name}: exists, kept")
            continue
        client.secrets.create(name=source.name, data=source.read(), labels={"sandkernel.cluster": "1"})
        progress(f"[secret] {source.name}: created" + (" (generated)" if source.path is None else ""))


def bring_up(
    *,
    stack_name: str,
    catalog_url_file: Path | None,
    tokens_file: Path | None,
    cluster_secret_file: Path | None,
    compose_files: tuple[Path, ...] = (),
    progress: Progress = print,
    client: docker.DockerClient | None = None,
) -> None:
    """`sandkernel cluster up`: on a Swarm manager, create the stack's secrets that are missing
    and ``docker stack deploy`` the shipped stack file (plus the operator's own compose files,
    merged over it). Blocking: a CLI command."""
    client = client or docker.from_env()
    swarm = client.info().get("Swarm") or {}
    if swarm.get("LocalNodeState") != "active" or not swarm.get("ControlAvailable"):
        raise DeployError("this Docker engine is not a Swarm manager: run `docker swarm init` (or use a manager)")
    create_secrets(
        client,
        [
            SecretSource("sandkernel_catalog_url", catalog_url_file),
            SecretSource("sandkernel_cluster_secret", cluster_secret_file, generate=True),
            SecretSource("sandkernel_tokens", tokens_file),
        ],
        progress,
    )
    docker_cli = shutil.which("docker")
    if docker_cli is None:
        raise DeployError("the docker command is not on PATH (`docker stack deploy` is a docker CLI feature)")
    with tempfile.TemporaryDirectory(prefix="sandkernel-stack-") as tmp:
        stack_file = Path(tmp) / STACK_FILE
        stack_file.write_text(stack_text())
        command = [docker_cli, "stack", "deploy", "--resolve-image", "never", "-c", str(stack_file)]
        for extra in compose_files:
            command += ["-c", str(extra)]
        progress(f"[deploy] docker stack deploy {stack_name} ({len(compose_files)} override file(s))")
        result = subprocess.run([*command, stack_name], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise DeployError(f"docker stack deploy failed: {(result.stderr or result.stdout).strip()[-800:]}")
    progress(f"[deploy] {stack_name}_{STACK_SERVICE}: one gateway per node, each on port 8888 of its node")
