"""The gateway's container image (issue 18: one gateway per Swarm host): built with no registry
from this checkout, it runs this checkout's sandkernel and holds the tools disk workspaces need.

The pure half checks what goes into the build: the requirements read from the wheel's metadata
(core plus the ``cluster`` extra, nothing of the other extras), the wheel shipping the
Dockerfile as package data, and the refusals (a wheel of another version). The docker half
builds the image for real (cached layers after the first build: about 6 s warm, about 55 s
cold on a fresh machine, most of it downloading and installing the wheelhouse) and runs it:
``--version`` says this checkout's version, the tools are on PATH, and ``doctor`` in the
container, given what a cluster host gives it (SYS_ADMIN, the loop devices, the engine's socket),
makes, mounts and removes a real disk workspace, and imports psycopg.

The catalog image (the stack's PostgreSQL, gateway/cluster/catalog_image.py) is built the same
way and run as the stack runs it: the password as a secret file of the postgres uid (0400), the
data in a named volume. It makes its cluster and database on the first start, takes the right
password and refuses a wrong one, keeps its data across a restart, and refuses to start
without the password file, saying which secret is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
import zipfile
from pathlib import Path

import docker.errors
import psycopg
import pytest

from sandkernel import __version__
from sandkernel.errors import ImageBuildError
from sandkernel.gateway.cluster.catalog_image import (
    CATALOG_IMAGE,
    CATALOG_PORT,
    POSTGRES_UID,
    build_catalog_image,
    catalog_url,
)
from sandkernel.gateway.cluster.gateway_image import (
    GATEWAY_IMAGE,
    build_context,
    build_gateway_image,
    build_wheel,
    requirements,
    source_checkout,
)
from sandkernel.gateway.cluster.launcher import DOCKER_SOCKET, GATEWAY_CAPABILITIES, LOOP_DEVICE_RULES
from sandkernel.kernels.sandbox.docker_engine import default_engine
from sandkernel.kernels.sandbox.labels import OWNER_LABEL, owner_label

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("mkfs.ext4", "losetup", "mount", "umount", "tar", "catatonit")


def make_wheel(path: Path, requires: list[str]) -> Path:
    """A minimal wheel holding only the METADATA :func:`requirements` reads."""
    lines = ["Metadata-Version: 2.1", "Name: sandkernel", f"Version: {__version__}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"sandkernel-{__version__}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_requirements_are_the_core_and_the_cluster_extra_only(tmp_path):
    """The core, the cluster extra and the extras of sandkernel's own it names (the server),
    each line once; the other extras (mcp, agent, test) stay out."""
    wheel = make_wheel(
        tmp_path / f"sandkernel-{__version__}-py3-none-any.whl",
        [
            "tornado>=6.4",
            'tomli>=2; python_version < "3.11"',
            'docker>=7.1; extra == "server"',
            'pillow>=10.0; extra == "server"',
            'anthropic>=0.40; extra == "agent"',
            'pillow>=10.0; extra == "agent"',
            'sandkernel[server]; extra == "cluster"',
            'psycopg[binary]>=3.1; extra == "cluster"',
            "psycopg-pool>=3.2; extra == 'cluster'",
            'sandkernel[server]; extra == "mcp"',
            'mcp>=2.3; extra == "mcp"',
            'sandkernel[agent,cluster,mcp,server]; extra == "test"',
        ],
    )
    assert requirements(wheel) == [
        "tornado>=6.4",
        'tomli>=2; python_version < "3.11"',
        "psycopg[binary]>=3.1",
        "psycopg-pool>=3.2",
        "docker>=7.1",
        "pillow>=10.0",
    ]


def test_a_compound_extra_marker_is_refused_rather_than_guessed(tmp_path):
    wheel = make_wheel(tmp_path / "w.whl", ['psycopg>=3; extra == "cluster" and python_version < "4"'])
    with pytest.raises(ImageBuildError, match="compound extra marker"):
        requirements(wheel)


def test_the_checkout_wheel_ships_the_dockerfile_and_needs_the_cluster_extra(tmp_path):
    assert source_checkout() == ROOT
    wheel = build_wheel(ROOT, tmp_path, lambda _: None)
    with zipfile.ZipFile(wheel) as zf:
        shipped = zf.read("sandkernel/gateway/cluster/image/Dockerfile")
    assert shipped == (ROOT / "gateway" / "cluster" / "image" / "Dockerfile").read_bytes()
    wanted = requirements(wheel)
    assert any(r.startswith("psycopg[binary]") for r in wanted) and any(r.startswith("docker") for r in wanted)
    assert not any(r.startswith(("mcp", "pytest", "sandkernel")) for r in wanted), wanted


def test_a_wheel_of_another_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    other = make_wheel(tmp_path / "sandkernel-9.9.9-py3-none-any.whl", [])
    with pytest.raises(ImageBuildError, match=f"sandkernel 9.9.9; this sandkernel is {__version__}"):
        build_context(lambda _: None, wheel=other)


def run_in_image(command: list[str], entrypoint: list[str] | None = None, **options) -> tuple[int, str]:
    """Run the gateway image to completion (owner-labelled, so the suite's leak check and other
    processes' reapers know whose it is) and return its exit code and output."""
    client = default_engine().client
    container = client.containers.run(
        GATEWAY_IMAGE, command, entrypoint=entrypoint, detach=True, labels={OWNER_LABEL: owner_label()}, **options
    )
    try:
        code = container.wait(timeout=120)["StatusCode"]
        return code, container.logs().decode()
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)


@pytest.fixture(scope="module")
def gateway_image() -> str:
    lines: list[str] = []
    image_id = build_gateway_image(progress=lines.append)
    assert lines[-1].startswith(f"[build] done: {GATEWAY_IMAGE}"), lines[-5:]
    return image_id


@pytest.mark.docker
def test_the_image_runs_this_checkouts_sandkernel_with_the_disk_tools(gateway_image):
    image = default_engine().client.images.get(GATEWAY_IMAGE)
    assert image.id == gateway_image
    assert image.labels["sandkernel.version"] == __version__
    assert image.labels["org.opencontainers.image.title"] == "sandkernel gateway"
    assert run_in_image(["--version"]) == (0, f"sandkernel {__version__}\n")
    script = "for t in " + " ".join(TOOLS) + ' ; do command -v "$t" || echo "missing $t"; done; '
    script += "sandkernel cluster image build --help >/dev/null && python -c 'import psycopg, psycopg_pool' && echo ok"
    code, output = run_in_image(["-c", script], entrypoint=["sh"])
    assert code == 0 and "missing" not in output and output.endswith("ok\n"), output
    assert sorted(Path(line).name for line in output.splitlines()[:-1]) == sorted(TOOLS)


@pytest.mark.docker
def test_doctor_in_the_image_makes_and_mounts_a_disk_workspace(gateway_image):
    """With the grants the Swarm launcher gives the gateway's container (gateway/cluster/launcher.py:
    SYS_ADMIN, the loop devices only, the engine's socket), ``doctor`` passes its disk check."""
    code, output = run_in_image(
        ["doctor"],
        cap_add=list(GATEWAY_CAPABILITIES),
        device_cgroup_rules=list(LOOP_DEVICE_RULES),
        network_mode="host",
        volumes={DOCKER_SOCKET: {"bind": DOCKER_SOCKET}, "/dev": {"bind": "/dev"}},
    )
    assert "[ok  ] disk workspaces: root, loop devices, mkfs.ext4 and mount available" in output, output
    assert "[ok  ] docker engine" in output and code == 0, output


PASSWORD_TARGET = "/run/secrets/catalog_password"  # where the stack mounts the secret


def wait_healthy(container, timeout: float = 60) -> str:
    """The container's health once the image's healthcheck (pg_isready) says healthy; the state
    it stopped in (``exited``) if it stops first. Docker has no event to wait on here that the
    SDK gives without a stream, so this polls, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        container.reload()
        health = container.attrs["State"].get("Health", {}).get("Status")
        if health == "healthy" or container.status in ("exited", "dead"):
            return health if health == "healthy" else container.status
        assert time.monotonic() < deadline, (container.status, health, container.logs().decode()[-2000:])
        time.sleep(0.5)


@pytest.mark.docker
def test_the_catalog_image_makes_its_database_on_first_start_and_keeps_it(tmp_path):
    started = time.monotonic()
    lines: list[str] = []
    image_id = build_catalog_image(progress=lines.append)
    assert lines[-1].startswith(f"[build] done: {CATALOG_IMAGE}"), lines[-5:]
    image = default_engine().client.images.get(CATALOG_IMAGE)
    assert image.id == image_id and image.labels["sandkernel.image"] == "catalog"
    print(f"[catalog image] built in {time.monotonic() - started:.1f} s, {image.attrs['Size'] / 1e6:.0f} MB")
    password = secrets.token_hex(24)
    secret = tmp_path / "catalog_password"
    secret.write_text(password)
    os.chown(secret, POSTGRES_UID, POSTGRES_UID)
    secret.chmod(0o400)
    client = default_engine().client
    volumes = [client.volumes.create(labels={OWNER_LABEL: owner_label()}) for _ in range(2)]
    containers = []

    def run(with_secret: bool = True, volume=volumes[0]):
        mounts = {volume.name: {"bind": "/var/lib/postgresql/data", "mode": "rw"}}
        if with_secret:
            mounts[str(secret)] = {"bind": PASSWORD_TARGET, "mode": "ro"}
        container = client.containers.run(CATALOG_IMAGE, detach=True, volumes=mounts, labels={OWNER_LABEL: owner_label()},
                                          ports={f"{CATALOG_PORT}/tcp": ("127.0.0.1", None)})  # fmt: skip
        containers.append(container)
        return container

    def url(container, password: str = password) -> str:
        container.reload()
        port = container.attrs["NetworkSettings"]["Ports"][f"{CATALOG_PORT}/tcp"][0]["HostPort"]
        return catalog_url("127.0.0.1", password, int(port))

    try:
        first = run()
        assert wait_healthy(first) == "healthy"
        with psycopg.connect(url(first), connect_timeout=10) as conn:
            who = conn.execute("SELECT current_user, current_database(), current_setting('server_version_num')")
            assert who.fetchone()[:2] == ("sandkernel", "sandkernel")
            conn.execute("CREATE TABLE kept (n int)")
            conn.execute("INSERT INTO kept VALUES (42)")
            method = conn.execute("SELECT rolpassword FROM pg_authid WHERE rolname = 'sandkernel'").fetchone()[0]
            assert method.startswith("SCRAM-SHA-256$")
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            psycopg.connect(url(first, "not-" + password), connect_timeout=10).close()
        top = first.top(ps_args="-o pid,uid")["Processes"]
        assert top and all(uid == str(POSTGRES_UID) for _, uid in top), top  # never root
        first.stop(timeout=30)  # SIGINT, fast shutdown
        assert first.wait(timeout=5)["StatusCode"] == 0
        again = run(with_secret=False)  # the volume's cluster is used as it is: no initdb, no password file
        assert wait_healthy(again) == "healthy"
        with psycopg.connect(url(again), connect_timeout=10) as conn:
            assert conn.execute("SELECT n FROM kept").fetchall() == [(42,)]
        again.stop(timeout=30)
        bare = run(with_secret=False, volume=volumes[1])  # a first start without the secret: refused, saying why
        assert wait_healthy(bare) == "exited" and bare.attrs["State"]["ExitCode"] == 2
        assert "sandkernel_catalog_password" in bare.logs().decode()
    finally:
        for container in containers:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        for volume in volumes:
            with contextlib.suppress(docker.errors.NotFound):
                volume.remove(force=True)
