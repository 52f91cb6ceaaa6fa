"""Build the gateway's container image, with no registry, for a Docker Swarm deployment (issue 18).

On every host of a cluster the gateway runs as a container (``sandkernel serve`` as root, the
Docker socket and /dev bound in): it starts kernel containers through the engine's socket and
makes disk workspaces with losetup, mkfs.ext4 and mount. This module builds that image the way
kernels/sandbox/image.py builds the kernel image, and with its parts: the same base
(:func:`~sandkernel.kernels.sandbox.image.choose_base`: python:3.11-slim, else the debootstrapped
``sandkernel-base:bookworm``), the same host-filled wheelhouse installed with ``--no-index``
(:func:`~sandkernel.kernels.sandbox.image.fill_wheelhouse`), the same classic-builder loop and
progress lines (:func:`~sandkernel.kernels.sandbox.image.docker_build`).

What goes in: sandkernel's own wheel, built on every build from the source checkout this module
runs from (its code changes; the bytes are reproducible, SOURCE_DATE_EPOCH, so an unchanged tree
reuses every cached layer), and its dependencies with the ``cluster`` extra. Which dependencies is
read from that wheel's metadata, so pyproject.toml stays the one place they are written; they are
downloaded again only when that list changes (fill_wheelhouse's stamp).

Why a checkout: an installed wheel is not its own source, and pip cannot rebuild a wheel from
site-packages. From an installed sandkernel the build needs a wheel (``--wheel PATH``), else it
stops with ImageBuildError saying to build from a checkout.

The build context is assembled in the cache (``~/.cache/sandkernel/gateway-image-<version>``),
never in the checkout or the installed package: the Dockerfile (package data,
gateway/cluster/image/), requirements.txt, wheelhouse/ (kept between builds) and dist/.
"""

from __future__ import annotations

import email.parser
import importlib.resources
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sandkernel import __version__
from sandkernel.errors import ImageBuildError
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.image import (
    Progress,
    cache_dir,
    choose_base,
    docker_build,
    fill_wheelhouse,
    run_command,
)

GATEWAY_IMAGE = f"sandkernel-gateway:{__version__}"
EXTRA = "cluster"  # the optional dependencies a cluster gateway needs (psycopg, its pool)
PACKAGE_DATA_DIR = "image"  # under sandkernel.gateway.cluster: the Dockerfile
CACHE_NAME = "gateway-image"
# Wheels built from a checkout carry this date, not the build's: an unchanged tree gives the same
# bytes, so docker's COPY of dist/ hits the cache and the build is all cached layers.
SOURCE_DATE_EPOCH = "315532800"  # 1980-01-01, the earliest date a zip entry can hold
# Not copied when git cannot list the tree: build output, caches, downloaded payloads.
TREE_IGNORE = (".git", ".venv", "build", "dist", "wheelhouse", "__pycache__", "*.egg-info", ".*_cache", "*.pyc")
_EXTRA_MARKER = re.compile(r"""^extra\s*==\s*["']([\w.-]+)["']$""")
_OWN_EXTRAS = re.compile(r"^sandkernel\s*\[([\w.,\s-]+)\]$")  # an extra that names others of sandkernel's


def dockerfile_dir() -> Path:
    """gateway/cluster/image/ as the package ships it (the checkout's folder in an editable
    install, package data in a wheel)."""
    return Path(str(importlib.resources.files("sandkernel.gateway.cluster").joinpath(PACKAGE_DATA_DIR)))


def source_checkout() -> Path | None:
    """The source checkout this module runs from (an editable install), or None when sandkernel
    is installed from a wheel. A checkout is the directory two levels above this file holding
    sandkernel's pyproject.toml; in site-packages that directory is the package itself."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and re.search(r'^name\s*=\s*"sandkernel"', pyproject.read_text(), re.MULTILINE):
        return root
    return None


def _copy_tree(root: Path, dest: Path) -> None:
    """The files of the checkout git tracks or would track (so a stale build/ cannot slip deleted
    modules into the wheel); without git, the tree minus :data:`TREE_IGNORE`."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        shutil.copytree(root, dest, ignore=shutil.ignore_patterns(*TREE_IGNORE), dirs_exist_ok=True)
        return
    for name in filter(None, listed.split("\0")):
        path = root / name
        if path.is_file():  # tracked but deleted in the working tree: not part of this build
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / name)


def build_wheel(root: Path, dest: Path, progress: Progress) -> Path:
    """Build sandkernel's wheel from the checkout at ``root`` into ``dest`` (``pip wheel
    --no-deps``, from a copy of the tree) and return its path. Without build isolation when this
    interpreter has setuptools (no index needed), with it otherwise."""
    progress(f"[wheel] building sandkernel {__version__} from {root}")
    with tempfile.TemporaryDirectory(prefix="sandkernel-gateway-src-") as src:
        _copy_tree(root, Path(src))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dest)]
        if importlib.util.find_spec("setuptools") is not None:
            cmd.append("--no-build-isolation")
        env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
        run_command([*cmd, src], progress, env)
    built = sorted(dest.glob("sandkernel-*.whl"))
    if len(built) != 1:
        raise ImageBuildError(f"expected one sandkernel wheel in {dest}, found {[p.name for p in built]}")
    return built[0]


def wheel_version(wheel: Path) -> str:
    """The version a wheel's file name states (``sandkernel-0.1.0-py3-none-any.whl``)."""
    parts = wheel.name.split("-")
    if len(parts) < 5 or parts[0] != "sandkernel" or wheel.suffix != ".whl":
        raise ImageBuildError(f"{wheel} is not a sandkernel wheel (sandkernel-<version>-...whl)")
    return parts[1]


def requirements(wheel: Path, extra: str = EXTRA) -> list[str]:
    """The requirement lines the image installs: the wheel's Requires-Dist with no extra marker
    plus those of ``extra`` (marker removed), and of the extras ``extra`` names of sandkernel's
    own (``sandkernel[server]``: the cluster gateway is a server), other extras dropped;
    environment markers (python_version...) are kept for pip to judge against the image's
    Python. Pure: unit-tested."""
    with zipfile.ZipFile(wheel) as zf:
        [metadata] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(zf.read(metadata).decode())
    by_extra: dict[str | None, list[str]] = {}
    for requirement in message.get_all("Requires-Dist") or []:
        spec, _, marker = requirement.partition(";")
        marker = marker.strip()
        named = _EXTRA_MARKER.match(marker)
        if not marker:
            by_extra.setdefault(None, []).append(spec.strip())
        elif named:
            by_extra.setdefault(named.group(1), []).append(spec.strip())
        elif "extra" not in marker:
            by_extra.setdefault(None, []).append(requirement.strip())
        else:
            raise ImageBuildError(f"cannot tell whether the image needs {requirement!r} (a compound extra marker)")
    lines: list[str] = []
    wanted, seen = [None, extra], set()
    while wanted:
        name = wanted.pop(0)
        if name in seen:
            continue
        seen.add(name)
        for spec in by_extra.get(name, []):
            own = _OWN_EXTRAS.match(spec)
            if own:
                wanted += [e.strip() for e in own.group(1).split(",")]
            elif spec not in lines:
                lines.append(spec)
    return lines


def build_context(progress: Progress, wheel: Path | None = None) -> Path:
    """Assemble the build context in :func:`cache_dir` and return it: the Dockerfile,
    requirements.txt (from the wheel, plus pip to install with), wheelhouse/ filled on the host
    (only when requirements.txt changed) and dist/ (sandkernel's wheel and pip's, renewed on
    every build). ``wheel`` is a prebuilt sandkernel wheel; without it one is built from the
    checkout, and an installed sandkernel without a wheel raises ImageBuildError."""
    context = cache_dir(CACHE_NAME)
    dist = context / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    if wheel is None:
        root = source_checkout()
        if root is None:
            raise ImageBuildError(
                "the gateway image installs sandkernel's own wheel, built from a source checkout, and this "
                f"sandkernel is installed from a wheel ({Path(__file__).parents[2]}): run `sandkernel cluster "
                "image build` from a checkout (git clone; pip install -e '.[cluster]'), or pass --wheel PATH"
            )
        wheel = build_wheel(root, dist, progress)
    else:
        version = wheel_version(wheel)
        if version != __version__:
            raise ImageBuildError(f"{wheel.name} is sandkernel {version}; this sandkernel is {__version__}")
        wheel = Path(shutil.copy2(wheel, dist / wheel.name))
    shutil.copy2(dockerfile_dir() / "Dockerfile", context / "Dockerfile")
    wanted = "\n".join(["pip", *requirements(wheel)]) + "\n"
    requirements_file = context / "requirements.txt"
    if not requirements_file.is_file() or requirements_file.read_text() != wanted:
        requirements_file.write_text(wanted)
    wheelhouse = fill_wheelhouse(progress, context)
    pips = sorted(wheelhouse.glob("pip-*.whl"))
    if not pips:
        raise ImageBuildError(f"no pip wheel in {wheelhouse}; remove it to download again")
    shutil.copy2(pips[-1], dist / pips[-1].name)
    progress(f"[context] {context}")
    return context


def build_gateway_image(
    tag: str = GATEWAY_IMAGE,
    base: str | None = None,
    offline: bool = False,
    wheel: Path | None = None,
    progress: Progress = print,
    engine: DockerEngine | None = None,
) -> str:
    """Build the gateway image and return its id. Blocking: for the CLI or a worker thread.
    ``base``/``offline`` as for the kernel image; ``wheel`` as for :func:`build_context`.
    Raises ImageBuildError naming the step that failed."""
    engine = engine or default_engine()
    context = build_context(progress, wheel)  # first: an installed sandkernel without --wheel stops here
    base = base or choose_base(engine, progress, offline=offline)
    return docker_build(engine, context, tag, base, progress)
