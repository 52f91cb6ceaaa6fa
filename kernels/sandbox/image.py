"""Build the kernel image, with or without a registry, from a checkout or an installed wheel.

Where the image's files come from (:func:`image_dir`): ``SANDKERNEL_IMAGE_DIR`` if set, else the
package data of an installed wheel (``sandkernel/kernel_image``, mapped from the repository's
top-level kernel-image/ by pyproject.toml), else kernel-image/ of the source checkout (editable
installs). A checkout or an explicit directory is the build context itself, as it always was; an
installed package is copied to a cache directory first (:func:`build_context`), because the
wheelhouse (~100 MB of wheels downloaded at build time) is not shipped in the wheel and an
installed package is no place to download into.

Steps, each reported on the progress callback:
1. Pick a base: ``python:3.11-slim`` if it is local or can be pulled; otherwise the
   debootstrapped Debian base (built once by kernel-image/bootstrap-base.sh, needs root).
2. Fill the context's wheelhouse/ with ``pip download`` on the host (cp311 manylinux wheels),
   skipped when requirements.txt has not changed since the last fill.
3. ``docker build`` with the classic builder (no buildx needed); the build itself needs no
   network. Layers are cached, so building twice is quick.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import docker.errors

from sandkernel import __version__
from sandkernel.errors import ImageBuildError
from sandkernel.kernels.model.profiles import DEFAULT_IMAGE
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine

HUB_BASE = "python:3.11-slim"
OFFLINE_BASE = "sandkernel-base:bookworm"
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")

Progress = Callable[[str], None]


PACKAGE_DATA_DIR = "kernel_image"  # under the sandkernel package, in an installed wheel
# Not copied into a cached build context: downloaded payload and bytecode of the package data.
CONTEXT_IGNORE = ("wheelhouse", "__pycache__", "*.pyc")


def _has_dockerfile(path: Path) -> bool:
    return (path / "Dockerfile").is_file()


def installed_image_dir() -> Path | None:
    """The image files shipped as package data of an installed sandkernel, if this is one."""
    packaged = Path(str(importlib.resources.files("sandkernel").joinpath(PACKAGE_DATA_DIR)))
    return packaged if _has_dockerfile(packaged) else None


def checkout_image_dir() -> Path:
    """kernel-image/ of the source checkout this module runs from (an editable install)."""
    return Path(__file__).resolve().parents[2] / "kernel-image"


def image_dir() -> Path:
    """Where the image's files are: SANDKERNEL_IMAGE_DIR, else the installed package data, else
    the checkout's kernel-image/. Raises ImageBuildError naming the fix when none holds a
    Dockerfile."""
    configured = os.environ.get("SANDKERNEL_IMAGE_DIR")
    path = Path(configured) if configured else installed_image_dir() or checkout_image_dir()
    if not _has_dockerfile(path):
        raise ImageBuildError(f"no Dockerfile in {path}; set SANDKERNEL_IMAGE_DIR to the kernel-image directory")
    return path


def cache_dir(name: str = "kernel-image") -> Path:
    """Where an image's build context is assembled when it cannot be built in place (XDG cache,
    per image ``name`` and version): the kernel image's from an installed package, the gateway
    image's (gateway/cluster/gateway_image.py) always."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandkernel" / f"{name}-{__version__}"


def build_context(progress: Progress = print) -> Path:
    """The directory ``docker build`` runs in, wheelhouse/ included. A checkout (or
    SANDKERNEL_IMAGE_DIR) is used in place; installed package data is copied to
    :func:`cache_dir`, refreshed on every build (stale files removed, so ``COPY *.py`` takes
    exactly the installed files) while the wheelhouse there is kept between builds."""
    source = image_dir()
    if os.environ.get("SANDKERNEL_IMAGE_DIR") or installed_image_dir() is None:
        return source
    context = cache_dir()
    context.mkdir(parents=True, exist_ok=True)
    for entry in context.iterdir():
        if entry.name == "wheelhouse":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    shutil.copytree(source, context, ignore=shutil.ignore_patterns(*CONTEXT_IGNORE), dirs_exist_ok=True)
    progress(f"[context] {source} copied to {context}")
    return context


def _has_image(engine: DockerEngine, ref: str) -> bool:
    try:
        engine.client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def choose_base(engine: DockerEngine, progress: Progress, offline: bool = False) -> str:
    """The base image to build on: the official slim image where possible, else our own."""
    if not offline:
        if _has_image(engine, HUB_BASE):
            return HUB_BASE
        progress(f"[base] pulling {HUB_BASE}")
        try:
            engine.client.images.pull(HUB_BASE)
            return HUB_BASE
        except docker.errors.APIError as err:
            reason = str(err.explanation or err)[:120]
            progress(f"[base] cannot pull {HUB_BASE} ({reason}); using a debootstrapped base")
    if _has_image(engine, OFFLINE_BASE):
        progress(f"[base] reusing {OFFLINE_BASE}")
        return OFFLINE_BASE
    script = image_dir() / "bootstrap-base.sh"
    if os.geteuid() != 0:
        raise ImageBuildError(f"building the offline base needs root: run `sudo bash {script} {OFFLINE_BASE}`")
    run_command([str(script), OFFLINE_BASE], progress)
    return OFFLINE_BASE


def fill_wheelhouse(progress: Progress, directory: Path | None = None) -> Path:
    """Download the image's wheels on the host (where pip has the CA bundle and the index) into
    ``directory``/wheelhouse (default: the build context)."""
    directory = directory or build_context(progress)
    requirements = directory / "requirements.txt"
    wheelhouse = directory / "wheelhouse"
    stamp = wheelhouse / ".requirements.sha256"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        progress(f"[wheels] {wheelhouse} is up to date")
        return wheelhouse
    wheelhouse.mkdir(exist_ok=True)
    progress(f"[wheels] pip download into {wheelhouse}")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(wheelhouse)]
    cmd += ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none"]
    for platform in WHEEL_PLATFORMS:
        cmd += ["--platform", platform]
    run_command([*cmd, "-r", str(requirements)], progress)
    stamp.write_text(digest)
    return wheelhouse


def run_command(cmd: list[str], progress: Progress, env: dict[str, str] | None = None) -> None:
    """Run a build step (debootstrap, pip) in ``env`` (default: this process's), its output
    lines on ``progress``; a non-zero exit raises ImageBuildError with the last lines, so the
    CLI prints why in one message."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            line = line.rstrip()
            if line and not line.startswith("WARNING: Location"):
                progress(line)
                tail = [*tail[-20:], line]
    if proc.returncode:
        raise ImageBuildError(f"{Path(cmd[0]).name} failed with exit code {proc.returncode}: {' | '.join(tail[-3:])}")


def build_image(
    tag: str = DEFAULT_IMAGE,
    base: str | None = None,
    offline: bool = False,
    progress: Progress = print,
    engine: DockerEngine | None = None,
) -> str:
    """Build the kernel image and return its id. Blocking: for the CLI or a worker thread."""
    engine = engine or default_engine()
    base = base or choose_base(engine, progress, offline=offline)
    context = build_context(progress)
    fill_wheelhouse(progress, context)
    return docker_build(engine, context, tag, base, progress)


def docker_build(
    engine: DockerEngine,
    context: Path,
    tag: str,
    base: str,
    progress: Progress,
) -> str:
    """``docker build`` of ``context`` with the classic builder (no buildx needed) on ``base``
    (the Dockerfile's BASE_IMAGE), labelled with sandkernel's version; returns the image id.
    The build steps and cache hits are reported on ``progress``; a failed step raises
    ImageBuildError with the builder's message. Shared by the kernel and gateway images, so
    both are built, labelled and reported the same way."""
    progress(f"[build] {tag} on {base}")
    image_id = None
    stream = engine.client.api.build(
        path=str(context),
        tag=tag,
        buildargs={"BASE_IMAGE": base},
        labels={"sandkernel.version": __version__, "sandkernel.base": base},
        rm=True,
        decode=True,
    )
    for chunk in stream:
        if "error" in chunk:
            raise ImageBuildError(f"docker build failed: {chunk['error'].strip()}")
        text = chunk.get("stream", "").strip()
        if text.startswith("Step ") or text.startswith("---> Using cache") or text[-2:] == "ok":
            progress(f"[build] {text}")
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
    if image_id is None:
        image_id = engine.client.images.get(tag).id
    progress(f"[build] done: {tag} ({image_id[7:19]})")
    return image_id
