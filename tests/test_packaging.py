"""A wheel, not only an editable checkout, can build the kernel image (issue 12, item 9).

The wheel is built from a copy of the working tree (the files git tracks or would track), so a
stale build/ directory in the checkout cannot slip files in. It must carry every file of
kernel-image/ as package data (whatever is there now: a new module of the image is shipped
without anyone editing a list) and the OpenAPI document, and never the wheelhouse payload.
Installed into a throwaway venv, the package's CLI answers and the build context it resolves is
its own package data (not this checkout), copied into a cache directory with its modes kept.
The dependencies come from this interpreter's site-packages through a .pth line, so nothing is
downloaded. ``test_the_installed_wheel_builds_the_image`` then runs the real build (docker tier).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_DIR = ROOT / "kernel-image"
REQUIRED = ("Dockerfile", "start_kernel.py", "launch-kernel", "seccomp_bpf.py", "egress_relay.py", "requirements.txt")
EXECUTABLE = ("launch-kernel", "bootstrap-base.sh")
PACKAGE_IMAGE_DIR = "sandkernel/kernel_image/"


def image_files() -> list[str]:
    """The files of kernel-image/ a wheel must ship: all of them but the wheelhouse and bytecode."""
    return sorted(
        p.name for p in IMAGE_DIR.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix != ".pyc"
    )


def run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    """Run a command (by default outside this checkout, whose sandkernel/ directory would shadow
    the installed package through ``sys.path[0]``) and return it, asserting it succeeded."""
    kw.setdefault("cwd", "/")
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built without build isolation (no index needed) from a copy of the tree."""
    src = tmp_path_factory.mktemp("src")
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file():  # tracked but deleted in the working tree: not part of this build
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", src, "-w", out)
    [built] = out.glob("sandkernel-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A throwaway venv holding the installed wheel; dependencies seen through a .pth line
    (plain paths in a .pth are added without running that directory's own .pth files, so this
    checkout's editable finder stays out)."""
    env = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel)
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (purelib / "zz_sandkernel_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


def test_the_wheel_ships_the_image_files_and_no_wheelhouse(wheel):
    with zipfile.ZipFile(wheel) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    shipped = sorted(n.removeprefix(PACKAGE_IMAGE_DIR) for n in infos if n.startswith(PACKAGE_IMAGE_DIR))
    assert set(REQUIRED) <= set(shipped), shipped
    assert shipped == image_files(), "the wheel's kernel_image differs from kernel-image/"
    assert "sandkernel/gateway/openapi.json" in infos
    assert not [n for n in infos if "wheelhouse" in n or n.endswith(".whl")]
    for name in EXECUTABLE:
        mode = infos[PACKAGE_IMAGE_DIR + name].external_attr >> 16
        assert mode & stat.S_IXUSR, f"{name} lost its executable bit in the wheel ({oct(mode)})"
    assert wheel.stat().st_size < 2 << 20, f"the wheel is {wheel.stat().st_size} bytes: a payload slipped in"


def test_the_wheel_ships_every_module_of_the_checkout(wheel):
    """A subpackage missing from pyproject's list works in an editable checkout and is missing
    from the wheel (the audit and policy packages once were): compare the two."""
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n for n in zf.namelist() if n.endswith(".py")}
    dirs = {
        "sandkernel": "sandkernel",
        "kernels": "sandkernel/kernels",
        "gateway": "sandkernel/gateway",
        "agent": "sandkernel/agent",
        "notebooks": "sandkernel/notebooks",
    }
    expected = {
        f"{package}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, package in dirs.items()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts and "examples" not in path.parts and (path.parent / "__init__.py").exists()
    }
    expected = {name.replace("sandkernel/agent/integrations/", "sandkernel/integrations/") for name in expected}
    assert not expected - shipped, f"modules missing from the wheel: {sorted(expected - shipped)}"


def test_the_installed_package_resolves_its_own_build_context(venv, tmp_path):
    sandkernel = venv / "bin" / "sandkernel"
    help_text = run(sandkernel, "image", "build", "--help").stdout
    assert "--tag" in help_text and "--offline" in help_text
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "SANDKERNEL_IMAGE_DIR"} | {"XDG_CACHE_HOME": str(cache)}
    probe = (
        "import sandkernel; from sandkernel.kernels.sandbox import image\n"
        "print(sandkernel.__file__); print(image.image_dir()); print(image.build_context(lambda _: None))"
    )
    package_file, source, context = map(Path, run(venv / "bin" / "python", "-c", probe, env=env).stdout.split())
    assert venv in package_file.parents, f"the venv imported {package_file}, not its installed wheel"
    assert venv in source.parents and source.name == "kernel_image", source
    assert cache in context.parents, context
    assert sorted(p.name for p in context.iterdir()) == image_files()
    for name in image_files():
        assert (context / name).read_bytes() == (IMAGE_DIR / name).read_bytes(), name
    for name in EXECUTABLE:
        assert os.access(context / name, os.X_OK), f"{name} is not executable in the build context"


@pytest.mark.docker
def test_the_installed_wheel_builds_the_image(venv, tmp_path):
    """The real `sandkernel image build` of the installed wheel, into a throwaway tag. The
    wheelhouse is seeded from this checkout's when that one matches requirements.txt (else the
    build downloads it, as a user's first build does); layers come from the build cache."""
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "SANDKERNEL_IMAGE_DIR"} | {"XDG_CACHE_HOME": str(cache)}
    probe = "from sandkernel.kernels.sandbox import image; print(image.cache_dir())"
    context = Path(run(venv / "bin" / "python", "-c", probe, env=env).stdout.strip())
    if (IMAGE_DIR / "wheelhouse" / ".requirements.sha256").is_file():
        shutil.copytree(IMAGE_DIR / "wheelhouse", context / "wheelhouse")
    tag = f"sandkernel-kernel:packaging-test-{os.getpid()}"
    try:
        proc = run(venv / "bin" / "sandkernel", "image", "build", "--tag", tag, env=env)
        assert f"copied to {context}" in proc.stdout and f"done: {tag}" in proc.stdout, proc.stdout[-2000:]
        listing = run("docker", "run", "--rm", "--entrypoint", "ls", tag, "/opt/sandkernel").stdout.split()
        assert {n for n in image_files() if n.endswith(".py")} | {"launch-kernel"} <= set(listing), listing
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)
