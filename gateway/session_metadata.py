"""A session's client metadata: the small JSON object a tenant labels its session with.

It is kept with the session (its catalog record, its transcript's header) and returned in every
session model, and the catalog record is rewritten as the session runs: an unbounded object (the
request body allows 40 MiB) would be re-encoded and rewritten for every execution. So it is
bounded, and copied once it is checked (the tenant's object is never kept).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sandkernel.errors import ConfigError, TooLargeError

MAX_METADATA_BYTES = 4096  # as compact JSON, UTF-8


def checked_metadata(metadata: object) -> dict[str, Any]:
    """A copy of ``metadata`` (None: empty) once it is a JSON object of at most
    MAX_METADATA_BYTES; ConfigError (400) or TooLargeError (413) saying what to fix."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError("metadata must be a JSON object")
    try:
        encoded = json.dumps(metadata, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise ConfigError(f"metadata must be plain JSON (no NaN or infinity): {err}") from None
    size = len(encoded.encode())
    if size > MAX_METADATA_BYTES:
        raise TooLargeError(
            f"metadata is {size} bytes as JSON; a session keeps at most {MAX_METADATA_BYTES}: "
            "keep names and tags there, and data in the workspace"
        )
    return json.loads(encoded)
