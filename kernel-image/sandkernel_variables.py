"""The variables listing the host asks for with a silent ``user_expressions`` request.

Why a module in the image rather than Python source kept as a string on the host: it can be
read, linted and tested like any code, and the host's request is one short call::

    __import__('sandkernel_variables').listing(get_ipython())

Why the call cannot be taken over by a file in the workspace: this module lives in
/opt/sandkernel (image-owned, root-owned, not writable by the sandbox user) and
start_kernel.py imports it before any user code exists, so the name is already bound in
``sys.modules`` when the expression runs. A ``sandkernel_variables.py`` planted in /workspace
(or in the workspace's site-packages, or found after the code puts ``'.'`` first on
``sys.path``) is never imported by that name. /opt/sandkernel also comes first on the kernel's
path, ahead of the workspace, in case the module was dropped from ``sys.modules``.

Contract: returns one JSON string (a list of ``{name, type, size, shape}``), evaluates no
code of the user's beyond attribute reads (``nbytes``, ``shape``, ``len``), lists at most
MAX_NAMES names, and never raises for a strange object (its size falls back to
``sys.getsizeof``, or 0).
"""

import json
import sys

# Names of the user's namespace looked at, at most (bounds the reply for a huge namespace).
MAX_NAMES = 2000
# Values that are program structure, not data: left out of the listing.
SKIPPED_TYPES = ("module", "function", "builtin_function_or_method", "type")
SIZED_TYPES = (str, bytes, list, tuple, dict, set)


def _type_name(value):
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else kind.__module__ + "." + kind.__qualname__


def _size(value):
    """Bytes for arrays and frames (``nbytes``), length for sized builtins, else getsizeof."""
    try:
        nbytes = int(getattr(value, "nbytes", 0) or 0)
    except Exception:  # a property that raises, a non-numeric nbytes: fall back
        nbytes = 0
    if nbytes:
        return nbytes
    if isinstance(value, SIZED_TYPES):
        return len(value)
    try:
        return sys.getsizeof(value)
    except Exception:
        return 0


def _shape(value):
    try:
        shape = getattr(value, "shape", None)
    except Exception:
        return None
    if not isinstance(shape, tuple):
        return None
    try:
        return [int(n) for n in shape]
    except (TypeError, ValueError):
        return None


def listing(shell):
    """JSON list of the user's variables in ``shell`` (an InteractiveShell): name, type, size, shape."""
    namespace, hidden = shell.user_ns, shell.user_ns_hidden
    entries = []
    for name, value in list(namespace.items())[:MAX_NAMES]:
        if not isinstance(name, str) or name.startswith("_") or name in hidden or type(value).__name__ in SKIPPED_TYPES:
            continue
        entries.append({"name": name, "type": _type_name(value), "size": _size(value), "shape": _shape(value)})
    return json.dumps(entries)
