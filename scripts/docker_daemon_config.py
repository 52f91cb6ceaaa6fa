"""Merge sandkernel's settings into Docker's daemon.json without dropping other settings.

Called by host-setup.sh as root: ``docker_daemon_config.py PATH [RUNSC]``. Sets
``"live-restore": true`` (restarting or upgrading dockerd leaves running containers, the
sandboxes, alone: durable sessions, issue 13) and, given a runsc to run (sandkernel's
``scripts/sandkernel-runsc`` as installed, which can also restore a memory image: see
docs/snapshots.md), registers gVisor as the ``runsc`` runtime. Prints whether the file changed,
so the caller knows a running dockerd needs a reload (SIGHUP re-reads runtimes and live-restore,
and leaves running containers alone).
"""

import json
import sys
from pathlib import Path

# --host-uds=all: the kernel binds its sockets in the runtime dir (create) and connects to its
# session's egress proxy socket (open). Only those two directories are mounted.
RUNSC_ARGS = ["--network=none", "--host-uds=all", "--platform=ptrace", "--oci-seccomp"]


def merged(config: dict, runsc: str | None) -> dict:
    """``config`` with sandkernel's settings in it (a new dict; everything else kept as it was)."""
    config = json.loads(json.dumps(config))
    config["live-restore"] = True
    if runsc:
        config.setdefault("runtimes", {})["runsc"] = {"path": runsc, "runtimeArgs": RUNSC_ARGS}
    return config


def main(path: str, runsc: str | None = None) -> None:
    config_path = Path(path)
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    wanted = merged(config, runsc)
    if wanted == config:
        print("unchanged")
        return
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(wanted, indent=2) + "\n")
    print("changed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
