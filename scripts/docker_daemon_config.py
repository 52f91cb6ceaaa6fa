"""Merge sandkernel's runsc runtime into Docker's daemon.json without dropping other settings.

Called by host-setup.sh as root. Prints whether the file changed so the caller knows a
running dockerd needs a reload (SIGHUP re-reads runtimes).
"""

import json
import sys
from pathlib import Path

# --host-uds=all: the kernel binds its sockets in the runtime dir (create) and connects to its
# session's egress proxy socket (open). Only those two directories are mounted.
RUNSC_ARGS = ["--network=none", "--host-uds=all", "--platform=ptrace", "--oci-seccomp"]


def main(path: str, runsc: str) -> None:
    config_path = Path(path)
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    wanted = {"path": runsc, "runtimeArgs": RUNSC_ARGS}
    if config.get("runtimes", {}).get("runsc") == wanted:
        print("unchanged")
        return
    config.setdefault("runtimes", {})["runsc"] = wanted
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    print("changed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
