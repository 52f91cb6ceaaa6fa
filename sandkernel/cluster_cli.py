"""``sandkernel cluster``: the commands of a many-host deployment (issue 18).

sandkernel cluster image build    build the gateway's container image, and with --catalog the
                                  catalog's (PostgreSQL) too (no registry needed)
sandkernel cluster stack          print the Swarm stack file
sandkernel cluster up             create the stack's secrets and deploy it (on a Swarm manager)
sandkernel cluster launch         the stack's task on each node: runs that node's gateway

Kept apart from sandkernel/cli.py so the cluster's commands grow in one place;
:func:`add_cluster_parser` is the one hook cli.py calls.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

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
--wheel; the build context is kept in ~/.cache/sandkernel/gateway-image-{__version__}/.

--catalog also builds sandkernel-catalog:{__version__}, the stack's PostgreSQL 15 (from Debian's
packages through apt, on the same base), needed only on the node that runs the catalog
(`sandkernel cluster up --catalog-node NODE`)."""

IMAGE_BUILD_EPILOG = f"""\
check it with the grants a cluster gives the gateway (CAP_SYS_ADMIN and the loop devices only):
  docker run --rm --cap-add SYS_ADMIN --device-cgroup-rule 'b 7:* rwm' --device-cgroup-rule 'c 10:237 rwm' \\
    --security-opt apparmor=unconfined -v /var/run/docker.sock:/var/run/docker.sock -v /dev:/dev \\
    sandkernel-gateway:{__version__} doctor"""

UP_DESCRIPTION = """\
Deploy sandkernel on the Docker Swarm this engine manages: create the stack's Docker secrets that
do not exist yet (an existing one is kept), then `docker stack deploy` the shipped stack file. Every
node then runs one gateway (port 8888 of the node), all sharing the PostgreSQL catalog.

The catalog, either way:
  --catalog-node NODE     the stack's own PostgreSQL runs on NODE (labelled sandkernel.catalog=true,
                          its data in a volume there, port 5432 of NODE's address); its password and
                          URL secrets are generated. It is the one place creates go through: back
                          its volume up. Give the same NODE on every later `up`.
  --catalog-url-file FILE your own PostgreSQL (its postgresql:// URL); the catalog service is left out.

Before: build the gateway image on every node (`sandkernel cluster image build`; on the catalog
node `sandkernel cluster image build --catalog`), have the kernel image there (`sandkernel image
build`). Files given here must be chmod 600."""

UP_EPILOG = """\
examples:
  sandkernel cluster up --catalog-node node-1 --tokens-file tokens.json
  printf '%s' 'postgresql://sandkernel:PASSWORD@10.0.0.5/sandkernel' > catalog.url; chmod 600 catalog.url
  sandkernel cluster up --catalog-url-file catalog.url --tokens-file tokens.json"""

LAUNCH_DESCRIPTION = """\
What the stack's service runs on each node (not for use by hand): start this node's gateway as a
sibling container on the node's engine (host network, CAP_SYS_ADMIN and the loop devices, the
host's state and runtime dirs), with the config and secrets Swarm gave this task, and live as long
as it does. SIGTERM stops the gateway (its sessions stay for the next one). Arguments after `--`
are passed to `sandkernel serve`."""


def _cmd_image_build(args: argparse.Namespace) -> int:
    from sandkernel.gateway.cluster.catalog_image import CATALOG_IMAGE, build_catalog_image
    from sandkernel.gateway.cluster.gateway_image import GATEWAY_IMAGE, build_gateway_image
    from sandkernel.kernels.sandbox.docker_engine import default_engine

    started = time.monotonic()
    tag = args.tag or GATEWAY_IMAGE
    build_gateway_image(tag=tag, base=args.base, offline=args.offline, wheel=args.wheel, progress=print)
    print(f"[build] took {time.monotonic() - started:.1f} s")
    if args.catalog:  # on the base the gateway image was just built on: one choice of base, one label
        started = time.monotonic()
        base = args.base or default_engine().client.images.get(tag).labels.get("sandkernel.base")
        build_catalog_image(tag=CATALOG_IMAGE, base=base, offline=args.offline, progress=print)
        print(f"[build] took {time.monotonic() - started:.1f} s")
    return 0


def _cmd_stack(args: argparse.Namespace) -> int:
    from sandkernel.gateway.cluster.deploy import stack_text

    print(stack_text(catalog=not args.no_catalog), end="")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from sandkernel.gateway.cluster.deploy import DeployError, bring_up

    try:
        bring_up(
            stack_name=args.name,
            catalog_url_file=args.catalog_url_file,
            tokens_file=args.tokens_file,
            cluster_secret_file=args.cluster_secret_file,
            catalog_node=args.catalog_node,
            tls=_tls_files(args),
            compose_files=tuple(args.compose_file),
        )
    except DeployError as err:
        print(f"sandkernel cluster up: {err}")
        return 2
    return 0


def _tls_files(args: argparse.Namespace) -> Any:
    """--tls-cert/--tls-key/--cluster-ca as deploy.TlsFiles (None without a certificate)."""
    from sandkernel.gateway.cluster.deploy import DeployError, TlsFiles

    if args.tls_cert is None and args.tls_key is None:
        if args.cluster_ca is not None:
            raise DeployError("--cluster-ca goes with --tls-cert and --tls-key (the gateways' certificate)")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise DeployError("HTTPS needs both --tls-cert and --tls-key (the certificate chain and its private key)")
    return TlsFiles(args.tls_cert, args.tls_key, args.cluster_ca)


def _cmd_launch(args: argparse.Namespace) -> int:
    import logging

    from sandkernel.gateway.cluster.launcher import LaunchError, launch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s launcher: %(message)s")
    serve_args = tuple(args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args)
    try:
        return launch(port=args.port, image=args.image, stop_timeout=args.stop_timeout, serve_args=serve_args)
    except LaunchError as err:
        logging.getLogger("sandkernel.launcher").error("%s", err)
        return 2


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``sandkernel cluster`` and its commands to the top-level subcommands ``sub``."""
    cluster = sub.add_parser(
        "cluster",
        help="many hosts (Docker Swarm, PostgreSQL): image, stack file, deploy",
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
    build.add_argument(
        "--catalog",
        action="store_true",
        help=f"also build sandkernel-catalog:{__version__} (PostgreSQL 15), for the node that runs the catalog",
    )
    build.set_defaults(func=_cmd_image_build)

    stack = commands.add_parser("stack", help="print the Docker Swarm stack file")
    stack.add_argument(
        "--no-catalog", action="store_true", help="without the catalog service (for your own PostgreSQL)"
    )
    stack.set_defaults(func=_cmd_stack)

    up = commands.add_parser(
        "up",
        help="create the secrets and deploy the stack (on a Swarm manager)",
        description=UP_DESCRIPTION,
        epilog=UP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument(
        "--catalog-node",
        metavar="NODE",
        help="run the stack's PostgreSQL on this node (name or id; password and URL secrets generated)",
    )
    up.add_argument("--catalog-url-file", type=Path, metavar="FILE", help="your own PostgreSQL: a file with its URL")
    up.add_argument("--tokens-file", type=Path, metavar="FILE", help='tenants\' tokens, JSON {"tenant": "token"}')
    up.add_argument(
        "--cluster-secret-file", type=Path, metavar="FILE", help="the secret gateways sign with (default: generated)"
    )
    up.add_argument(
        "--tls-cert",
        type=Path,
        metavar="FILE",
        help="PEM certificate chain for every gateway (its names cover every node's address): HTTPS for clients "
        "and TLS between the gateways",
    )
    up.add_argument("--tls-key", type=Path, metavar="FILE", help="the PEM private key of --tls-cert (chmod 600)")
    up.add_argument(
        "--cluster-ca", type=Path, metavar="FILE", help="the PEM CA the gateways check each other's certificate with"
    )
    up.add_argument(
        "--compose-file",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="your own compose file merged over the stack file (e.g. gateway flags); may be repeated",
    )
    up.add_argument("--name", default="sandkernel", help="stack name (default: sandkernel)")
    up.set_defaults(func=_cmd_up)

    launch = commands.add_parser(
        "launch",
        help="run this node's gateway (the stack's task; not for use by hand)",
        description=LAUNCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_argument("--port", type=int, default=8888, help="the gateway's port on the node (default: 8888)")
    launch.add_argument("--image", default=None, help="gateway image (default: the image this task runs)")
    launch.add_argument(
        "--stop-timeout",
        type=float,
        default=45.0,
        metavar="S",
        help="seconds the gateway gets to stop before SIGKILL (above its --shutdown-grace; default: 45)",
    )
    launch.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for `sandkernel serve`")
    launch.set_defaults(func=_cmd_launch)
