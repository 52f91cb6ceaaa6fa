"""Where a constant path lands in the sandbox, and whether code may write there.

Relative paths are taken from /workspace (the kernel's working directory) and ``~`` is
/workspace too (HOME there), so ``../../etc/passwd`` is seen for what it reaches. A ``%cd`` in an
earlier cell is not known here: the review is advisory and judges the cell alone.
"""

from __future__ import annotations

import posixpath
import re

WORKSPACE = "/workspace"
DEFAULT_WRITABLE = ("/workspace", "/tmp")
# Device files code writes to without touching a file system (`> /dev/null` in a shell line).
HARMLESS = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/fd/", "/proc/self/fd/")
_TRAVERSAL = re.compile(r"(?:^|/)\.\.(?:/|$)")


def resolve(path: str) -> str | None:
    """The absolute, normalised path ``path`` names in the sandbox; None when it cannot be known
    (a shell variable other than $HOME, an empty string)."""
    path = path.strip()
    if not path:
        return None
    for home in ("$HOME", "${HOME}", "~"):
        if path == home or path.startswith(home + "/"):
            path = WORKSPACE + path[len(home) :]
            break
    if path.startswith("$") or path.startswith("~"):
        return None
    if not path.startswith("/"):
        path = posixpath.join(WORKSPACE, path)
    normal = posixpath.normpath(path)
    return "/" + normal.lstrip("/")  # normpath keeps a leading '//'


def writable(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a resolved absolute path is under one of ``prefixes`` (or a harmless device)."""
    if any(path == h.rstrip("/") or (h.endswith("/") and path.startswith(h)) for h in HARMLESS):
        return True
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def traverses(text: str) -> bool:
    """Whether a word (a string constant, a shell token) holds a ``..`` path segment: ``../x``,
    ``a/../b``, ``..``; not ``...`` nor ``1..2``."""
    return any(_TRAVERSAL.search(word) for word in text.split())


def describe(prefixes: tuple[str, ...]) -> str:
    return ", ".join(prefixes) if prefixes else "nowhere"
