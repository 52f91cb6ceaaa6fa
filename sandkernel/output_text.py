"""What a person reads of an execution's outputs: one rule, for the server's results and the client's.

Streams (stdout, stderr) and the ``text/plain`` of results and displays, in order; errors are
not included (they are reported as the execution's error). Lives in the common base because
both the session layer and the client library (which must not import the server) need it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def readable_text(outputs: Iterable[dict[str, Any]]) -> str:
    """Stdout, stderr and text/plain results of nbformat-shaped ``outputs``, in order."""
    parts = []
    for output in outputs:
        if output.get("output_type") == "stream":
            parts.append(str(output.get("text", "")))
        elif output.get("output_type") in ("execute_result", "display_data"):
            plain = (output.get("data") or {}).get("text/plain")
            if isinstance(plain, str) and plain:
                parts.append(plain if plain.endswith("\n") else plain + "\n")
    return "".join(parts)
