"""Where sandkernel keeps what must outlive its process: the session catalog, workspace disks.

One place decides it: the path the gateway was given (``--state-dir``, applied with
:func:`use_state_dir` before any session starts), else ``SANDKERNEL_STATE_DIR``, else
/var/lib/sandkernel for root and ``$XDG_STATE_HOME/sandkernel`` (~/.local/state) for others.
The directory is made 0700 and must belong to this user: tenants' files (workspace disk
images) and the catalog (which holds every kernel's HMAC key) live under it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sandkernel.errors import ConfigError

# Every container names the state dir of the process that made it: a reaper run against another
# state dir (``sandkernel reap``, a second gateway) then spares sandboxes recorded in that one's
# catalog, which a stopped gateway left running for its next start.
STATE_DIR_LABEL = "sandkernel.state_dir"

_chosen: Path | None = None


def use_state_dir(path: str | os.PathLike[str] | None) -> Path | None:
    """Make ``path`` this process's state dir (None: back to the default); returns the choice it
    replaces, for a caller that is done with it to put back (an in-process gateway that stops)."""
    global _chosen
    previous, _chosen = _chosen, Path(path).absolute() if path is not None else None
    return previous


def default_state_dir() -> Path:
    if os.environ.get("SANDKERNEL_STATE_DIR"):
        return Path(os.environ["SANDKERNEL_STATE_DIR"]).absolute()
    if os.geteuid() == 0:
        return Path("/var/lib/sandkernel")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sandkernel"


def state_dir(subdir: str = "") -> Path:
    """The state dir (or a named subdirectory of it), created 0700 and checked to be ours.

    A path that exists but is not a real directory of this user's (a symlink, another user's
    directory) is refused with a ConfigError that says which path to fix."""
    root = _chosen or default_state_dir()
    path = root / subdir if subdir else root
    for directory in (root, path) if subdir else (root,):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(
                f"state dir {directory} is not a directory owned by this user; fix it or choose another --state-dir"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(directory, 0o700)
    return path
