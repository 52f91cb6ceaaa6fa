"""Build the catalog's container image, PostgreSQL 15, with no registry (issue 18: the stack's
``catalog`` service).

The stack file (gateway/cluster/image/stack.yml) runs one PostgreSQL for the cluster's shared
session catalog, pinned to the node labelled ``sandkernel.catalog=true``, its data in a named
volume there. This module builds that server's image the way gateway_image.py builds the gateway's:
on the same base (:func:`~sandkernel.kernels.sandbox.image.choose_base`: python:3.11-slim or the
debootstrapped ``sandkernel-base:bookworm``, Debian 12 either way), PostgreSQL from Debian's own
packages through apt (the mirror the kernel image's catatonit comes from; no Docker Hub), with the
same classic-builder loop and progress lines (:func:`~sandkernel.kernels.sandbox.image.docker_build`).

What the image does is in its two files (package data beside the gateway's Dockerfile):
``catalog.Dockerfile`` (the postgres user as uid 999, no default cluster, a healthcheck, SIGINT
as the stop signal) and ``catalog-start.sh`` (initdb on first start with the password from the
Docker secret file, scram-sha-256, the ``sandkernel`` database). The facts the rest of sandkernel
needs about it (the user, database, port, the uid the secret is given to) are the constants below;
tests/test_cluster_deploy.py checks that the files say the same.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sandkernel import __version__
from sandkernel.gateway.cluster.gateway_image import dockerfile_dir
from sandkernel.kernels.sandbox.docker_engine import DockerEngine, default_engine
from sandkernel.kernels.sandbox.image import Progress, cache_dir, choose_base, docker_build

CATALOG_IMAGE = f"sandkernel-catalog:{__version__}"
CACHE_NAME = "catalog-image"
DOCKERFILE = "catalog.Dockerfile"
START_SCRIPT = "catalog-start.sh"
CATALOG_USER = "sandkernel"  # the superuser initdb makes; the gateways log in as it
CATALOG_DATABASE = "sandkernel"
CATALOG_PORT = 5432
POSTGRES_UID = 999  # the image's postgres user: the password secret is given to it (mode 0400)


def catalog_url(address: str, password: str, port: int = CATALOG_PORT) -> str:
    """The ``postgresql://`` URL the gateways use to reach the bundled catalog at ``address``
    (a node's Swarm address) with ``password`` (URL-safe: generated as hex)."""
    return f"postgresql://{CATALOG_USER}:{password}@{address}:{port}/{CATALOG_DATABASE}"


def build_context(progress: Progress) -> Path:
    """The build context in :func:`cache_dir` (``catalog-image-<version>``): the Dockerfile and
    the start script, copied afresh from the package data on every build."""
    context = cache_dir(CACHE_NAME)
    context.mkdir(parents=True, exist_ok=True)
    source = dockerfile_dir()
    shutil.copy2(source / DOCKERFILE, context / "Dockerfile")
    shutil.copy2(source / START_SCRIPT, context / START_SCRIPT)
    progress(f"[context] {context}")
    return context


def build_catalog_image(
    tag: str = CATALOG_IMAGE,
    base: str | None = None,
    offline: bool = False,
    progress: Progress = print,
    engine: DockerEngine | None = None,
) -> str:
    """Build the catalog image and return its id. Blocking: for the CLI or a worker thread.
    ``base``/``offline`` as for the kernel image. Raises ImageBuildError naming the failed step
    (an apt-get that cannot reach Debian's mirror among them)."""
    engine = engine or default_engine()
    context = build_context(progress)
    base = base or choose_base(engine, progress, offline=offline)
    return docker_build(engine, context, tag, base, progress)
