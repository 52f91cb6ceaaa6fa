"""``sandkernel cluster``: the commands of a many-host deployment (issue 18).

sandkernel cluster image build    build the gateway's container image (no registry needed)

Kept apart from sandkernel/cli.py so the cluster's commands grow in one place;
:func:`add_cluster_parser` is the one hook cli.py calls.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from sandkernel import __version__

IMAGE_BUILD_DESCRIPTION = f"""\
Build the image every host of a cluster runs the gateway from: sandkernel {__version__} with
its `cluster` extra (psycopg) in /opt/sandkernel, the tools disk workspaces need (losetup,
mkfs.ext4, mount, tar) and catatonit as init; ENTRYPOINT `sandkernel`, so
`docker run IMAGE serve ...` runs the gateway.

No registry is needed: the base is python:3.11-slim if it can be had, else the debootstrapped
sandkernel-base:bookworm (as for `sandkernel image build`); the Python packages are downloaded
on this host into a cached wheelhouse (again only when pyproject.toml's dependencies change)
and installed with --no-index. sandkernel's own wheel is built from this source checkout on
every build (unchanged code reuses every cached layer). From an installed sandkernel, pass
--wheel; the build context is kept in ~/.cache/sandkernel/gateway-image-{__version__}/."""

IMAGE_BUILD_EPILOG = f"""\
run it as a cluster does (root, the engine's socket, /dev for loop devices):
  docker run --rm --privileged --network host -v /var/run/docker.sock:/var/run/docker.sock \\
    -v /dev:/dev sandkernel-gateway:{__version__} doctor"""


def _cmd_image_build(args: argparse.Namespace) -> int:
    from sandkernel.gateway.cluster.gateway_image import GATEWAY_IMAGE, build_gateway_image

    started = time.monotonic()
    build_gateway_image(
        tag=args.tag or GATEWAY_IMAGE, base=args.base, offline=args.offline, wheel=args.wheel, progress=print
    )
    print(f"[build] took {time.monotonic() - started:.1f} s")
    return 0


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``sandkernel cluster`` and its commands to the top-level subcommands ``sub``."""
    cluster = sub.add_parser(
        "cluster",
        help="many hosts (Docker Swarm, PostgreSQL): the gateway image",
        description="Commands for running sandkernel on many hosts (a Docker Swarm with a PostgreSQL catalog).",
    )
    commands = cluster.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)
    image = commands.add_parser(
        "image",
        help="the gateway's container image",
        description="The gateway's container image, run by every host of a cluster.",
    ).add_subparsers(dest="cluster_image_command", metavar="COMMAND", required=True)
    build = image.add_parser(
        "build",
        help="build the gateway image (no registry needed)",
        description=IMAGE_BUILD_DESCRIPTION,
        epilog=IMAGE_BUILD_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_argument("--tag", default=None, help=f"image tag (default: sandkernel-gateway:{__version__})")
    build.add_argument("--base", default=None, help="base image to build on (default: python:3.11-slim or debootstrap)")
    build.add_argument("--offline", action="store_true", help="do not try to pull; use the debootstrapped base")
    build.add_argument(
        "--wheel",
        type=Path,
        default=None,
        metavar="PATH",
        help="install this sandkernel wheel instead of building one from the checkout (needed when sandkernel "
        "is installed from a wheel; its version must be this sandkernel's)",
    )
    build.set_defaults(func=_cmd_image_build)
