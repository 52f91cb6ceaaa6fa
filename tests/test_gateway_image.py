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
"""

from __future__ import annotations

import contextlib
import zipfile
from pathlib import Path

import docker.errors
import pytest

from sandkernel import __version__
from sandkernel.errors import ImageBuildError
from sandkernel.gateway.cluster.gateway_image import (
    GATEWAY_IMAGE,
    build_context,
    build_gateway_image,
    build_wheel,
    requirements,
    source_checkout,
)
from sandkernel.gateway.cluster.launcher import DOCKER_SOCKET, GATEWAY_CAPABILITIES, LOOP_DEVICE_RULES
from sandkernel.kernels.lifecycle.reaper import OWNER_LABEL, owner_label
from sandkernel.kernels.sandbox.docker_engine import default_engine

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
    wheel = make_wheel(
        tmp_path / f"sandkernel-{__version__}-py3-none-any.whl",
        [
            "docker>=7.1",
            'tomli>=2; python_version < "3.11"',
            'psycopg[binary]>=3.1; extra == "cluster"',
            "psycopg-pool>=3.2; extra == 'cluster'",
            'mcp>=2.3; extra == "mcp"',
            'sandkernel[cluster,deepagents,mcp]; extra == "test"',
        ],
    )
    assert requirements(wheel) == [
        "docker>=7.1",
        'tomli>=2; python_version < "3.11"',
        "psycopg[binary]>=3.1",
        "psycopg-pool>=3.2",
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
