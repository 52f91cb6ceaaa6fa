"""Jupyter websocket message framing (the legacy JSON / binary format JupyterLab speaks).

A message without binary buffers travels as a JSON text frame. With buffers it is one binary
frame: a big-endian u32 count N (the JSON part plus each buffer), N u32 offsets from the start
of the frame, then the JSON bytes and the buffers back to back.
"""

from __future__ import annotations

import itertools
import json
import struct
from typing import Any

from jupyter_client.jsonutil import json_default


class FrameError(ValueError):
    """A websocket frame that is not a valid Jupyter message."""


def to_frame(msg: dict[str, Any]) -> str | bytes:
    buffers = [bytes(b) for b in msg.get("buffers") or []]
    body = {k: v for k, v in msg.items() if k != "buffers"}
    text = json.dumps(body, default=json_default)
    if not buffers:
        return text
    parts = [text.encode(), *buffers]
    offsets = [4 * (len(parts) + 1)]
    for part in parts[:-1]:
        offsets.append(offsets[-1] + len(part))
    return struct.pack(f"!{len(parts) + 1}I", len(parts), *offsets) + b"".join(parts)


def from_frame(frame: str | bytes) -> dict[str, Any]:
    """Decode a client frame; raises FrameError with what is wrong."""
    try:
        if isinstance(frame, str):
            msg = json.loads(frame)
            buffers: list[bytes] = []
        else:
            (count,) = struct.unpack("!I", frame[:4])
            if not 1 <= count <= 1024 or len(frame) < 4 * (count + 1):
                raise FrameError("binary frame has a bad buffer count")
            offsets = [*struct.unpack(f"!{count}I", frame[4 : 4 * (count + 1)]), len(frame)]
            if any(b < a for a, b in itertools.pairwise(offsets)) or offsets[-2] > len(frame):
                raise FrameError("binary frame has bad offsets")
            parts = [frame[a:b] for a, b in itertools.pairwise(offsets)]
            msg = json.loads(parts[0].decode())
            buffers = parts[1:]
    except (ValueError, struct.error, UnicodeDecodeError) as err:
        raise FrameError(f"not a Jupyter message: {err}") from None
    except RecursionError:
        raise FrameError("not a Jupyter message: nested too deeply to be read") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("header"), dict) or "msg_type" not in msg["header"]:
        raise FrameError("a Jupyter message needs a header with a msg_type")
    msg.setdefault("parent_header", {})
    msg.setdefault("metadata", {})
    msg.setdefault("content", {})
    msg["buffers"] = buffers
    return msg
