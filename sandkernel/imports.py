"""Import choices for the processes sandkernel starts itself (its CLI; the test suite's workers),
made at their entry point and never as a side effect of importing a library module.

``jsonschema``, which nbformat and the MCP SDK import, imports ``rfc3987_syntax`` whenever it is
installed (jupyter-server's jupyter-events pulls it in, so most Jupyter machines have it), and that
module compiles a Lark grammar at import: about 3 s of CPU in every gateway process that starts,
before it serves a request. It only backs jsonschema's optional ``iri`` format checks, which
neither nbformat nor the MCP SDK asks for (neither passes a format checker).
"""

from __future__ import annotations

import sys

UNUSED_SLOW_MODULES = ("rfc3987_syntax",)


def skip_unused_slow_imports() -> None:
    """Make :data:`UNUSED_SLOW_MODULES` unimportable in this process (``import`` raises
    ImportError, which jsonschema expects of an optional module), unless already imported."""
    for name in UNUSED_SLOW_MODULES:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None: "not importable"
