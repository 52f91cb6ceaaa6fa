"""The files a Swarm deployment is made of, as shipped with the package: the stack file.

One place for the stack file's text (package data next to the gateway image's Dockerfile), so
`sandkernel cluster stack`, `sandkernel cluster up` and the tests deploy the same file, and the
one way to bring a cluster up (:func:`bring_up`).

Two ways to have the catalog, one stack file: its ``catalog`` service (PostgreSQL from
catalog_image.py on the node labelled ``sandkernel.catalog=true``; ``cluster up --catalog-node``
labels the node and makes the password and the URL pointing at that node), or the operator's own
PostgreSQL (``--catalog-url-file``), for which the catalog service's parts are left out of the
file (:func:`stack_text` with ``catalog=False``).
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker

from sandkernel.gateway.cluster.catalog_image import CATALOG_PORT, catalog_url

Progress = Callable[[str], None]

STACK_FILE = "stack.yml"
STACK_SERVICE = "gateway"  # the service's name inside the stack file
CATALOG_SERVICE = "catalog"  # the bundled PostgreSQL's service name inside the stack file
CATALOG_LABEL = "sandkernel.catalog"  # the node label the catalog service is constrained to (=true)
CATALOG_PASSWORD_SECRET = "sandkernel_catalog_password"
CATALOG_URL_SECRET = "sandkernel_catalog_url"
# The stack file's entries that make the catalog service, as (top-level section, key): left out
# when the operator brings PostgreSQL.
CATALOG_PARTS = frozenset({("services", CATALOG_SERVICE), ("volumes", "catalog_data"), ("secrets", "catalog_password")})
SECRET_NAMES = {  # the stack's external Docker secrets -> what each holds
    CATALOG_PASSWORD_SECRET: "the bundled catalog's PostgreSQL password (initdb reads it on its first start)",
    CATALOG_URL_SECRET: "the postgresql:// URL of the cluster catalog (with its password)",
    "sandkernel_cluster_secret": "the secret the gateways sign forwarded requests with (32+ bytes)",
    "sandkernel_tokens": 'the tenants\' tokens file, JSON {"tenant": "token"}',
    "sandkernel_tls_cert": "the gateways' PEM certificate chain (its names cover every node's address)",
    "sandkernel_tls_key": "the PEM private key of that certificate",
    "sandkernel_cluster_ca": "the PEM CA the gateways check each other's certificate with",
}
# The TLS secrets (Docker secret name -> the name the launcher reads in /run/secrets), added to
# the gateway service by a generated override when `cluster up --tls-cert` is used.
TLS_SECRETS = {
    "sandkernel_tls_cert": "tls_cert",
    "sandkernel_tls_key": "tls_key",
    "sandkernel_cluster_ca": "cluster_ca",
}


def stack_text(catalog: bool = True) -> str:
    """The stack file for ``docker stack deploy``: the gateway as a global service and, unless
    ``catalog`` is False (the operator's own PostgreSQL), the catalog service."""
    text = importlib.resources.files("sandkernel.gateway.cluster").joinpath("image", STACK_FILE).read_text()
    return text if catalog else _without(text, CATALOG_PARTS)


def _without(text: str, parts: frozenset[tuple[str, str]]) -> str:
    """``text`` less the entries ``parts`` names, and less a top-level section they leave empty.

    Why not a YAML parser: sandkernel does not depend on one, and a parse and dump would lose the
    file's comments. The stack file is our own block-style YAML (top-level sections at column 0,
    their entries at column 2), and that is all this reads; tests/test_cluster_deploy.py checks
    the result against a real parser."""
    kept: list[str] = []
    section, skipping = "", False
    for line in text.splitlines(keepends=True):
        content = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if content and not content.startswith("#"):
            if indent == 0:
                section, skipping = content.split(":", 1)[0], False
            elif indent == 2:
                skipping = (section, content.split(":", 1)[0]) in parts
        if not skipping:
            kept.append(line)
    result: list[str] = []
    for i, line in enumerate(kept):  # a section whose entries all went: its header goes too
        is_header = line[:1] not in ("", " ", "#", "\n") and line.rstrip().endswith(":")
        following = next((n for n in kept[i + 1 :] if n.strip() and not n.lstrip().startswith("#")), "")
        if is_header and not following.startswith(" "):
            continue
        result.append(line)
    return "".join(result)


class DeployError(Exception):
    """The stack cannot be deployed; the message says what to fix."""


@dataclass(frozen=True)
class SecretSource:
    """Where one of the stack's secrets comes from: a file the operator wrote (chmod 600), or
    generated here when the operator gave none and may (only the cluster secret)."""

    name: str
    path: Path | None
    generate: bool = False
    value: bytes | None = field(default=None, repr=False)  # made here (the bundled catalog's password and URL)

    def read(self) -> bytes:
        if self.value is not None:
            return self.value
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


@dataclass(frozen=True)
class CatalogNode:
    """The node the bundled catalog runs on: its id, name and Swarm address (where the gateways
    reach PostgreSQL's host-mode port)."""

    id: str
    name: str
    address: str
    labelled: bool


def find_catalog_node(client: docker.DockerClient, wanted: str) -> CatalogNode:
    """The Swarm node ``wanted`` names (hostname or id, or a unique id prefix) as the catalog's
    node. Changes nothing. DeployError when no node or several match, when it is not ready and
    active (the catalog could not start there), when it has no address, or when another node
    already carries the catalog label (the catalog's data volume is on that node: moving it is
    the operator's step, see docs/scale-out.md)."""
    nodes = client.nodes.list()
    matched = [n for n in nodes if wanted in (n.attrs["Description"].get("Hostname"), n.id)]
    matched = matched or [n for n in nodes if n.id.startswith(wanted)]
    names = sorted(str(n.attrs["Description"].get("Hostname")) for n in nodes)
    if len(matched) != 1:
        found = "no node of this swarm matches" if not matched else f"{len(matched)} nodes of this swarm match"
        raise DeployError(f"--catalog-node {wanted!r}: {found} (its nodes: {', '.join(names)})")
    node = matched[0]
    name = str(node.attrs["Description"].get("Hostname"))
    status, availability = node.attrs["Status"].get("State"), node.attrs["Spec"].get("Availability")
    if status != "ready" or availability != "active":
        raise DeployError(f"node {name} is {status}/{availability}: the catalog needs a ready, active node")
    others = [
        str(n.attrs["Description"].get("Hostname"))
        for n in nodes
        if n.id != node.id and (n.attrs["Spec"].get("Labels") or {}).get(CATALOG_LABEL) == "true"
    ]
    if others:
        raise DeployError(
            f"node {others[0]} already has the label {CATALOG_LABEL}=true: the catalog's data volume is there. "
            f"Keep it there (--catalog-node {others[0]}), or move the data yourself and remove the label "
            f"(docker node update --label-rm {CATALOG_LABEL} {others[0]})"
        )
    address = node.attrs["Status"].get("Addr") or ""
    if address in ("", "0.0.0.0"):  # a manager may report no address here; its manager address has it
        address = str((node.attrs.get("ManagerStatus") or {}).get("Addr", "")).rpartition(":")[0]
    if not address:
        raise DeployError(f"node {name} reports no Swarm address for the gateways to reach the catalog at")
    labelled = (node.attrs["Spec"].get("Labels") or {}).get(CATALOG_LABEL) == "true"
    return CatalogNode(node.id, name, address, labelled)


def label_catalog_node(client: docker.DockerClient, node: CatalogNode, progress: Progress) -> None:
    """Put the catalog label on ``node`` (kept if there)."""
    if node.labelled:
        progress(f"[catalog] node {node.name}: labelled {CATALOG_LABEL}=true already")
        return
    found = client.nodes.get(node.id)
    spec = dict(found.attrs["Spec"])
    spec["Labels"] = {**(spec.get("Labels") or {}), CATALOG_LABEL: "true"}
    found.update(spec)
    progress(f"[catalog] node {node.name}: labelled {CATALOG_LABEL}=true")


def catalog_secret_sources(client: docker.DockerClient, node: CatalogNode) -> list[SecretSource]:
    """The bundled catalog's two secrets: a generated password and the URL for it at ``node``'s
    address, made together. Both existing: kept (the password is the one the volume was made
    with). Only one existing: DeployError, since a Docker secret cannot be read back to make the
    other from it. Changes nothing."""
    existing = {s.name for s in client.secrets.list()}
    has_password, has_url = CATALOG_PASSWORD_SECRET in existing, CATALOG_URL_SECRET in existing
    if has_password and not has_url:
        raise DeployError(
            f"the secret {CATALOG_PASSWORD_SECRET} exists but {CATALOG_URL_SECRET} does not, and a Docker secret "
            f"cannot be read back to make the URL: create it from the password you kept (printf "
            f"'{catalog_url(node.address, 'PASSWORD')}' | docker secret create {CATALOG_URL_SECRET} -), or, if no "
            f"catalog volume was ever made with it, docker secret rm {CATALOG_PASSWORD_SECRET}"
        )
    if has_url and not has_password:
        raise DeployError(
            f"the secret {CATALOG_URL_SECRET} exists (your own PostgreSQL's URL?) but {CATALOG_PASSWORD_SECRET} "
            "does not: to use the bundled catalog, remove the stack and that secret first (docker stack rm; docker "
            f"secret rm {CATALOG_URL_SECRET}); to keep your PostgreSQL, leave out --catalog-node"
        )
    password = secrets.token_hex(24)  # hex: safe in a URL as it is; used only when both are created
    return [
        SecretSource(CATALOG_PASSWORD_SECRET, None, value=password.encode()),
        SecretSource(CATALOG_URL_SECRET, None, value=catalog_url(node.address, password).encode()),
    ]


@dataclass(frozen=True)
class TlsFiles:
    """The operator's files for TLS between clients, gateways and each other (chmod 600)."""

    cert: Path
    key: Path
    ca: Path | None = None

    def check(self) -> None:
        """DeployError unless the certificate and key make a usable pair (checked here, before
        anything is deployed, rather than by every gateway failing to start)."""
        from sandkernel.errors import ConfigError
        from sandkernel.gateway.tls import server_context

        try:
            server_context(self.cert, self.key)
        except ConfigError as err:
            raise DeployError(str(err)) from None

    def sources(self) -> list[SecretSource]:
        paths = {"sandkernel_tls_cert": self.cert, "sandkernel_tls_key": self.key, "sandkernel_cluster_ca": self.ca}
        return [SecretSource(name, path) for name, path in paths.items() if path is not None]


def tls_override(tls: TlsFiles) -> dict[str, Any]:
    """The compose override that gives the gateway service the TLS secrets (0400, root)."""
    names = [source.name for source in tls.sources()]
    return {
        "version": "3.8",
        "services": {
            STACK_SERVICE: {
                "secrets": [{"source": TLS_SECRETS[n], "target": TLS_SECRETS[n], "mode": 0o400} for n in names]
            }
        },
        "secrets": {TLS_SECRETS[n]: {"external": True, "name": n} for n in names},
    }


def bring_up(
    *,
    stack_name: str,
    catalog_url_file: Path | None,
    tokens_file: Path | None,
    cluster_secret_file: Path | None,
    catalog_node: str | None = None,
    tls: TlsFiles | None = None,
    compose_files: tuple[Path, ...] = (),
    progress: Progress = print,
    client: docker.DockerClient | None = None,
) -> None:
    """`sandkernel cluster up`: on a Swarm manager, create the stack's secrets that are missing
    and ``docker stack deploy`` the shipped stack file (plus the operator's own compose files,
    merged over it). With ``catalog_node``, the stack's catalog service runs there (the node
    labelled, its password and URL secrets made); without it, ``catalog_url_file`` (or an existing
    URL secret) names the operator's PostgreSQL and the catalog service is left out. Every check
    runs before anything is changed. Blocking: a CLI command. Raises DeployError."""
    if catalog_node is not None and catalog_url_file is not None:
        raise DeployError(
            "--catalog-node runs the stack's own PostgreSQL and makes its URL; --catalog-url-file points at "
            "your own PostgreSQL: give one of them"
        )
    if catalog_node is not None and not catalog_node.strip():
        raise DeployError("--catalog-node needs a node's name or id (docker node ls)")
    if tls is not None:
        tls.check()
        for source in tls.sources():  # readable by the operator only, like the other secrets' files
            source.read()
    client = client or docker.from_env()
    swarm = client.info().get("Swarm") or {}
    if swarm.get("LocalNodeState") != "active" or not swarm.get("ControlAvailable"):
        raise DeployError("this Docker engine is not a Swarm manager: run `docker swarm init` (or use a manager)")
    common = [
        SecretSource("sandkernel_cluster_secret", cluster_secret_file, generate=True),
        SecretSource("sandkernel_tokens", tokens_file),
        *(tls.sources() if tls is not None else []),
    ]
    if catalog_node is None:
        create_secrets(client, [SecretSource(CATALOG_URL_SECRET, catalog_url_file), *common], progress)
    else:
        node = find_catalog_node(client, catalog_node.strip())
        sources = catalog_secret_sources(client, node)
        existing = {s.name for s in client.secrets.list()}
        for source in common:  # the operator's files are checked before the node is touched
            if source.name not in existing:
                source.read()
        label_catalog_node(client, node, progress)
        create_secrets(client, [*sources, *common], progress)
        progress(f"[catalog] PostgreSQL on {node.name}, port {CATALOG_PORT} of {node.address}")
    docker_cli = shutil.which("docker")
    if docker_cli is None:
        raise DeployError("the docker command is not on PATH (`docker stack deploy` is a docker CLI feature)")
    with tempfile.TemporaryDirectory(prefix="sandkernel-stack-") as tmp:
        stack_file = Path(tmp) / STACK_FILE
        stack_file.write_text(stack_text(catalog=catalog_node is not None))
        command = [docker_cli, "stack", "deploy", "--resolve-image", "never", "-c", str(stack_file)]
        if tls is not None:
            tls_file = Path(tmp) / "tls.yml"
            tls_file.write_text(json.dumps(tls_override(tls)))  # JSON is YAML
            command += ["-c", str(tls_file)]
            progress("[deploy] gateways serve HTTPS and forward to each other over TLS")
        for extra in compose_files:
            command += ["-c", str(extra)]
        progress(f"[deploy] docker stack deploy {stack_name} ({len(compose_files)} override file(s))")
        result = subprocess.run([*command, stack_name], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise DeployError(f"docker stack deploy failed: {(result.stderr or result.stdout).strip()[-800:]}")
    progress(f"[deploy] {stack_name}_{STACK_SERVICE}: one gateway per node, each on port 8888 of its node")
