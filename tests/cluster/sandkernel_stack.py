"""sandkernel deployed on the swarm lab as a user would: the shipped stack file, Docker secrets,
`docker stack deploy`, one gateway per host (tests/test_cluster_swarm.py).

Only test plumbing lives here: the cluster is brought up with the product's own command
(``sandkernel cluster up --catalog-node``: secrets, the shipped stack file with its PostgreSQL
service, the gateway and catalog images); the test's one override file changes the gateway's
flags (fast heartbeats, no warm pool, a tenant limit) and the update monitor, the knobs an
operator would turn the same way (``--compose-file``). The catalog's URL (its password generated
by ``cluster up``) is read back from where Swarm put it, a gateway task's secret file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from sandkernel.gateway.cluster.deploy import CATALOG_SERVICE, STACK_SERVICE

from ..certificates import Certificates
from .commands import LabError, run, wait_for
from .lab import Lab, docker_env

STACK = "sk"
SERVICE = f"{STACK}_{STACK_SERVICE}"
CATALOG = f"{STACK}_{CATALOG_SERVICE}"
CATALOG_HOST = 1  # the node the catalog runs on: not the one test_cluster_swarm.py kills (host 3)
PORT = 8888


class Endpoint:
    """One host's gateway, reached from the test process on the lab network: over HTTPS, checked
    against the test's CA, when the cluster was brought up with certificates (``ca``)."""

    def __init__(self, host: int, ip: str, ca: Path | None = None) -> None:
        self.host = host
        self.ca = str(ca) if ca is not None else None
        self.url = f"{'https' if ca is not None else 'http'}://{ip}:{PORT}"

    def request(self, path: str, **kw: Any) -> HTTPRequest:
        """An HTTPRequest to this gateway (``ws``: its websocket URL), trusting the test's CA."""
        url = self.url.replace("http", "ws", 1) + path if kw.pop("ws", False) else self.url + path
        return HTTPRequest(url, ca_certs=self.ca, **kw)

    async def call(self, method: str, path: str, body: Any = None, *, token: str, raw: bytes | None = None,
                   timeout: float = 120, **kw: Any) -> tuple[int, Any]:  # fmt: skip
        """(status, JSON or text) of one request."""
        data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
        if method in ("POST", "PUT") and data is None:
            data = b""
        request = self.request(path, method=method, body=data, request_timeout=timeout,
                               headers={"Authorization": f"token {token}"}, **kw)  # fmt: skip
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as err:
            if err.response is None:
                return 599, str(err)
            response = err.response
        except OSError as err:
            return 599, str(err)
        text = response.body.decode(errors="replace") if response.body else ""
        try:
            return response.code, json.loads(text) if text else None
        except ValueError:
            return response.code, text


def override(serve_args: Sequence[str]) -> dict[str, Any]:
    """The test's compose override: the gateway's extra flags, a short update monitor."""
    return {
        "version": "3.8",
        "services": {
            STACK_SERVICE: {
                "command": ["cluster", "launch", "--port", str(PORT), "--", *serve_args],
                "deploy": {"update_config": {"monitor": "3s", "delay": "1s"}},
            }
        },
    }


def deploy(lab: Lab, workdir: Path, *, cluster_secret: str, tokens: dict[str, str], serve_args: Sequence[str],
           tls: Certificates | None = None) -> str:  # fmt: skip
    """``sandkernel cluster up`` against host 1's engine, as an operator runs it: the catalog on
    host :data:`CATALOG_HOST` (``--catalog-node``), the other secrets from chmod-600 files, the
    shipped stack file plus the test's override. Its output."""
    files = {"cluster.secret": cluster_secret, "tokens.json": json.dumps(tokens)}
    for name, text in files.items():
        (workdir / name).write_text(text)
        (workdir / name).chmod(0o600)
    tls_flags: list[str] = []
    if tls is not None:  # the operator's files: chmod 600, as cluster up asks
        for flag, source in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--cluster-ca", tls.ca)):
            (workdir / source.name).write_bytes(source.read_bytes())
            (workdir / source.name).chmod(0o600)
            tls_flags += [flag, str(workdir / source.name)]
    override_file = workdir / "override.yml"
    override_file.write_text(yaml.safe_dump(override(serve_args)))
    env = {**docker_env(), "DOCKER_HOST": lab.host(1).docker_host}
    result = run([str(Path(sys.executable).with_name("sandkernel")), "cluster", "up", "--name", STACK,
                  "--catalog-node", lab.host(CATALOG_HOST).name, "--tokens-file", str(workdir / "tokens.json"),
                  "--cluster-secret-file", str(workdir / "cluster.secret"), "--compose-file", str(override_file),
                  *tls_flags],
                 env=env, timeout=300)  # fmt: skip
    return result.stdout


def deployed_catalog_url(lab: Lab, host: int = 1) -> str:
    """The catalog URL ``cluster up`` made, read from the secret file Swarm mounted into the
    gateway service's task on ``host`` (the launcher; root may read it)."""
    found = lab.docker(host, "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={SERVICE}").stdout.split()
    if not found:
        raise LabError(f"no running task of {SERVICE} on host {host}")
    return lab.docker(host, "exec", found[0], "cat", "/run/secrets/catalog_url").stdout.strip()


def catalog_container(lab: Lab) -> dict[str, Any] | None:
    """The catalog service's running container (on :data:`CATALOG_HOST`), inspected; None if none."""
    out = lab.docker(CATALOG_HOST, "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={CATALOG}",
                     check=False).stdout.split()  # fmt: skip
    if not out:
        return None
    found = lab.docker(CATALOG_HOST, "inspect", out[0], check=False)
    return json.loads(found.stdout)[0] if found.returncode == 0 else None


def gateway_container(lab: Lab, host: int) -> dict[str, Any] | None:
    """The running gateway container on a host (the launcher's sibling), inspected; None if none."""
    out = lab.docker(host, "ps", "-q", "--filter", "label=sandkernel.role=gateway", check=False).stdout.split()
    if not out:
        return None
    found = lab.docker(host, "inspect", out[0], check=False)
    return json.loads(found.stdout)[0] if found.returncode == 0 else None


async def wait_answering(endpoints: Sequence[Endpoint], token: str, timeout: float = 120) -> None:
    """Every endpoint answers an authenticated GET /api/sessions with 200."""
    import asyncio

    deadline = time.monotonic() + timeout
    pending = list(endpoints)
    while pending:
        results = await asyncio.gather(*(e.call("GET", "/api/sessions", token=token, timeout=10) for e in pending))
        pending = [e for e, (status, _) in zip(pending, results, strict=True) if status != 200]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise LabError(f"gateways not answering after {timeout} s: {[e.url for e in pending]} {results}")
        await asyncio.sleep(1)


def wait_update_done(lab: Lab, timeout: float = 300) -> str:
    """Wait for the service's rolling update to end; its final state (``completed`` expected)."""

    def state() -> str | None:
        out = lab.docker(1, "service", "inspect", SERVICE, "--format", "{{json .UpdateStatus}}").stdout.strip()
        status = json.loads(out) if out and out != "null" else {}
        current = status.get("State", "")
        return current if current in ("completed", "paused", "rollback_completed", "rollback_paused") else None

    return wait_for(f"the rolling update of {SERVICE}", state, timeout, 1.0)
