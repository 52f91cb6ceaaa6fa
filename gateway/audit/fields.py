"""What goes into an audit record, bounded: the fields come from tenants (code, file paths,
tags, error text), so each is made JSON-safe and size-limited before it is sealed.

* Code (``code``, and a shell-door command ``shell``): the SHA-256 of the whole text is always
  kept (``code_sha256``, ``shell_sha256``: UTF-8, lone surrogates encoded as they are, so two
  different strings never share a hash), and its length (``code_chars``) whenever the text is
  not kept whole; the text itself is kept up to its first :data:`MAX_CODE_CHARS` characters (then
  the cut marker) when the operator keeps code, else dropped. A prefix, not 64 Ki characters as
  before: a tenant sending large cells must not fill the log (and so its retention, see
  retention.py) with them; the transcript keeps the whole cell, and the hash finds it there.
  A :class:`DigestOnly` value keeps its hash and length only (an execution the audit gate refused).
* Other text: :data:`MAX_TEXT_CHARS` (head and tail, marker with the SHA-256).
* Lists: :data:`MAX_ITEMS` items, then a marker string saying how many were cut; nesting
  :data:`MAX_DEPTH` levels; non-finite floats and values JSON has no type for become strings.
* The whole record: :data:`MAX_RECORD_BYTES`; over it, the largest fields are replaced, one by
  one, by ``{"omitted_bytes": n, "sha256": ...}`` and named in ``omitted`` (a field that is an
  object is entered first, so a cell's accounting keeps its CPU and memory when only its list of
  files is too long: ``omitted`` then names ``accounting.files.created``).

Escaping is the sealer's (chain.py: ASCII-only JSON), so nothing here can break a line.
Runs on the audit log's worker thread, never on the event loop (hashing megabytes of code is
not free).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from sandkernel.gateway.audit.chain import RESERVED
from sandkernel.truncation import cut_marker

MAX_CODE_CHARS = 4096
MAX_TEXT_CHARS = 8192
MAX_ITEMS = 1000
MAX_DEPTH = 8
MAX_RECORD_BYTES = 64 * 1024
CODE_FIELDS = ("code", "shell")
# Never replaced when a record is too large: they say what the record is about.
_KEPT_WHOLE = frozenset({"seq", "time", "event", "prev", "tenant", "session", "door", "status"})
# Bytes a record may still gain once fitted: "omitted" itself, and the seal's ``,"hash":"..."``.
_FIT_MARGIN = 256


class DigestOnly(str):
    """Code a record keeps the SHA-256 and length of, never the text, whatever the operator chose:
    the code of an execution the audit gate refused, whose tenant already writes too much."""

    __slots__ = ()


def text_sha256(text: str) -> str:
    """SHA-256 of ``text`` as UTF-8 (``surrogatepass``: any str, one hash per distinct str)."""
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def clip(text: str, keep: int, what: str, digest: str | None = None) -> str:
    """``text`` itself when at most ``keep`` characters, else its head and tail around the marker
    (with the SHA-256 of the whole)."""
    if len(text) <= keep:
        return text
    half = keep // 2
    marker = cut_marker(len(text) - 2 * half, "characters", what, "audit record limit", digest or text_sha256(text))
    return text[:half] + marker + (text[-half:] if half else "")


def prefix(text: str, keep: int, what: str, digest: str) -> str:
    """``text`` itself when at most ``keep`` characters, else its first ``keep`` and the marker
    (with the SHA-256 of the whole)."""
    if len(text) <= keep:
        return text
    return text[:keep] + cut_marker(len(text) - keep, "characters", what, "audit record limit", digest)


def bound(value: Any, depth: int = 0) -> Any:
    """``value`` made JSON-ready and bounded (see the module docstring)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return clip(value, MAX_TEXT_CHARS, "text")
    if depth >= MAX_DEPTH:
        return clip(repr(value), MAX_TEXT_CHARS, "nested value")
    if isinstance(value, dict):
        items = list(value.items())
        out = {clip(str(k), MAX_TEXT_CHARS, "key"): bound(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["omitted_keys"] = len(items) - MAX_ITEMS
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        out_list = [bound(v, depth + 1) for v in items[:MAX_ITEMS]]
        if len(items) > MAX_ITEMS:
            out_list.append(cut_marker(len(items) - MAX_ITEMS, "items", "list", "audit record limit").strip())
        return out_list
    if hasattr(value, "value") and isinstance(value.value, (str, int)):  # an enum
        return value.value
    return clip(str(value), MAX_TEXT_CHARS, "value")


def prepare(fields: dict[str, Any], include_code: bool) -> dict[str, Any]:
    """The fields of one record, bounded: code fields hashed (and kept or dropped), names the log
    reserves renamed ``field_<name>``, every value through :func:`bound`."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        key = f"field_{name}" if name in RESERVED else name
        if name in CODE_FIELDS and isinstance(value, str):
            digest = text_sha256(value)
            keep_text = include_code and not isinstance(value, DigestOnly)
            out[f"{name}_sha256"] = digest
            if len(value) > MAX_CODE_CHARS or not keep_text:
                out[f"{name}_chars"] = len(value)
            if keep_text:
                out[key] = prefix(str(value), MAX_CODE_CHARS, name, digest)
            continue
        out[key] = bound(value)
    return out


def fit(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` itself when its JSON (sealed) is within :data:`MAX_RECORD_BYTES`, else with its
    largest fields replaced by their size and SHA-256 until it fits (named in ``omitted``)."""
    over = len(_json(record)) + _FIT_MARGIN - MAX_RECORD_BYTES
    if over <= 0:
        return record
    record = dict(record)
    omitted: list[str] = []
    _shrink(record, over, "", omitted, _KEPT_WHOLE)
    record["omitted"] = omitted
    return record


def _shrink(value: dict[str, Any], over: int, path: str, omitted: list[str], kept: frozenset[str]) -> int:
    """Replace entries of ``value`` in place, largest first, until ``over`` bytes are saved (an
    object is shrunk inside when that is enough, else replaced whole); the bytes still over."""
    sizes = {k: len(_json(v)) for k, v in value.items() if k not in kept}
    for name in sorted(sizes, key=sizes.__getitem__, reverse=True):
        if over <= 0:
            break
        child = value[name]
        if isinstance(child, dict):
            inner, found = dict(child), []
            left = _shrink(inner, over, f"{path}{name}.", found, frozenset())
            if left <= 0:
                value[name] = inner
                omitted.extend(found)
                return left
        raw = _json(child)
        stub = {"omitted_bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        saved = len(raw) - len(_json(stub)) - len(path + name) - 4  # its name goes into "omitted"
        if saved <= 0:
            continue
        value[name] = stub
        omitted.append(path + name)
        over -= saved
    return over


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii")
