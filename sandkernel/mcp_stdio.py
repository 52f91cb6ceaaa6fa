"""``sandkernel mcp``: the MCP server on stdin/stdout, for desktop clients (Claude Code, Claude
Desktop, Cursor) that start one server process per conversation or window.

The process runs a gateway of its own (loopback, fresh token, private state dir, as
local_gateway.py does) and serves the MCP tools (gateway/mcp/tools.py) over stdio for one
caller: one default sandbox session, started on the first tool call, plus any the model starts
with ``create_session``. stdout is the protocol, so everything else goes to stderr: the logs and
the one start-up line with the gateway's URL and token (open JupyterLab on the live kernel with
it).

When the client goes away the sessions go too, whichever way it leaves:

- it closes stdin (a normal exit; a client killed with SIGKILL closes it too): the sessions
  are deleted and the process exits;
- SIGTERM, SIGHUP or SIGINT (a client's escalation, a closed terminal): the same, and the process
  exits without waiting for the stdin reader thread (a read of a pipe nobody closed never ends);
- the process itself is killed with SIGKILL mid-way (MCP clients send SIGKILL a few seconds
  after SIGTERM): an *undertaker*, a small process started in a session of its own (so a kill of
  the server's process group spares it), waits for the server to die and then removes its
  containers (reaper.reap_sync with the server's owner label) and its state dir. The reaper of
  a later gateway would not: the containers are recorded in this process's catalog, and
  recorded sandboxes are kept for adoption.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sandkernel.errors import SandkernelError

log = logging.getLogger(__name__)

RUNTIME_CHOICES = ["auto", "runc", "runsc"]
UNDERTAKER_POLL_SECONDS = 0.5


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``mcp`` subcommand's flags (sandkernel/cli.py calls this)."""
    parser = sub.add_parser(
        "mcp",
        help="serve MCP on stdin/stdout: stateful Python sandboxes as tools for Claude Code, Claude Desktop, ...",
        description="Serve the Model Context Protocol on stdin/stdout (add it to a client with "
        "`claude mcp add sandkernel -- sandkernel mcp`). One sandbox session is started on the first tool call "
        "and deleted when the client goes away. Logs, and the local gateway's URL and token (to open "
        "JupyterLab on the live kernel), go to stderr.",
    )
    parser.add_argument("--runtime", choices=RUNTIME_CHOICES, default="auto", help="container runtime (default auto)")
    parser.add_argument("--profile", default=None, help="profile of the default session: default, small or large")
    parser.add_argument("--notebook-dir", default=None, metavar="DIR", help="where the session notebooks go")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="pause a session idle this long (its next call resumes it), seconds (0: never; default 3600)",
    )
    parser.add_argument("--port", type=int, default=0, help="loopback port of the local gateway (default: a free one)")
    parser.set_defaults(func=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    return asyncio.run(serve_stdio(args))


async def serve_stdio(args: argparse.Namespace) -> int:
    """Serve until the client goes away; then delete every session and stop the gateway."""
    from sandkernel.gateway.auth import DEFAULT_TENANT, new_token
    from sandkernel.gateway.mcp.resolver import TenantResolver
    from sandkernel.gateway.mcp.tools import build_mcp_server
    from sandkernel.gateway.server import Gateway
    from sandkernel.gateway.settings import GatewaySettings
    from sandkernel.kernels.sandbox.labels import owner_label
    from sandkernel.local_gateway import LOCAL_DEFAULTS, free_port

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    state = Path(tempfile.mkdtemp(prefix="sandkernel-mcp-"))
    _start_undertaker(owner_label(), state)
    token = new_token()
    settings = GatewaySettings(
        ip="127.0.0.1",
        port=args.port or free_port(),
        token=token,
        notebook_dir=Path(args.notebook_dir) if args.notebook_dir else None,
        default_runtime=args.runtime,
        idle_timeout=args.idle_timeout or None,
        **{**LOCAL_DEFAULTS, "state_dir": state},
    )
    serving: asyncio.Task | None = None
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the protocol's, even before it starts
            gateway = await Gateway.start(settings)
        try:
            gateway.registry.catalog.for_tenant(args.profile, {})  # a bad --profile stops here, not at the first call
            resolver = TenantResolver(gateway.registry, DEFAULT_TENANT, {"profile": args.profile})
            server = build_mcp_server(lambda ctx: resolver, gateway.service)
            print(
                f"sandkernel mcp: gateway {gateway.url} (runtime {gateway.default_runtime}), token {token}; "
                f"JupyterLab: jupyter lab --gateway-url={gateway.url} --GatewayClient.auth_token={token}",
                file=sys.stderr,
                flush=True,
            )
            serving = asyncio.create_task(server.run_stdio_async())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            why = "a signal" if stop.is_set() else "the client closed stdin"
            log.info("the MCP client went away (%s): deleting its sessions", why)
            if serving.done() and not serving.cancelled() and serving.exception() is not None:
                log.error("the MCP server failed: %s", serving.exception())
            await resolver.close_all()
        finally:
            await gateway.stop()
    except SandkernelError as err:
        print(f"sandkernel mcp: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if serving is not None and not serving.done():
        # The stdin reader is a worker thread blocked in read() on a pipe the client still holds:
        # neither cancelling it nor interpreter shutdown would return. Everything is cleaned up.
        sys.stderr.flush()
        os._exit(0)
    return 0


# -- the undertaker: removes the server's sandboxes if the server is killed -----------------------


def _start_undertaker(owner: str, state: Path) -> None:
    """Start the watcher of this process (see the module docstring). Its stdio is /dev/null: it
    must not hold the client's pipes open after the server is gone."""
    subprocess.Popen(
        [sys.executable, "-m", "sandkernel.mcp_stdio", "undertaker", owner, str(state)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def undertake(owner: str, state: Path) -> None:
    """Wait for the process ``owner`` names (host:pid:start) to die, then remove what it left."""
    from sandkernel.kernels.lifecycle.reaper import reap_sync
    from sandkernel.kernels.sandbox.labels import owner_alive
    from sandkernel.kernels.sandbox.state_dir import use_state_dir

    while owner_alive(owner):
        time.sleep(UNDERTAKER_POLL_SECONDS)
    if state.exists():  # else the server got to its last step: its sandboxes are gone already
        use_state_dir(state)  # where the containers' workspace disks live
        with contextlib.suppress(SandkernelError, OSError):
            reap_sync(owner=owner)
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["undertaker"] and len(sys.argv) == 4:
    undertake(sys.argv[2], Path(sys.argv[3]))
