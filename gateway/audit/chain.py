"""The audit stream's line format and file names: what the writer seals and the verifier checks.

One record is one line of JSON (ASCII only: every other character is escaped, so no value a
tenant sends can break the line framing, and U+2028 or a lone surrogate stays an escape):

    {"seq":7,"time":"...","event":"execution",<fields>,"prev":"<hash of seq 6>","hash":"<hash of this>"}

``hash`` is the SHA-256 (hex) of the line's own bytes up to ``,"hash"`` with the closing ``}``
put back, that is, of the record as serialised without its ``hash``; ``prev`` is the ``hash`` of
the record before it (:data:`GENESIS` for the very first record of a log). So a record edited in
place no longer matches its own ``hash`` (the verifier names that line), a record whose ``hash``
was recomputed no longer matches the next record's ``prev``, and a deleted or reordered record
breaks ``seq`` and ``prev``. Hashing the bytes, not a re-serialisation, keeps the check independent
of any JSON library's key order or number formatting.

Files: the writer appends to ``audit.jsonl``; at rotation that file is renamed
``audit-<first seq, 12 digits>.jsonl`` and the chain goes on in a fresh ``audit.jsonl`` (its first
record's ``prev`` is the last record of the rotated file).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
CURRENT_NAME = "audit.jsonl"
ROTATED_RE = re.compile(r"^audit-(\d{12,})(?:-\d+)?\.jsonl$")
# Keys every record has, written by the log itself; a field of the same name is renamed.
RESERVED = frozenset({"seq", "time", "event", "prev", "hash"})

_SUFFIX_RE = re.compile(rb',"hash":"([0-9a-f]{64})"\}$')
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


class BrokenRecord(ValueError):
    """A line that is not a sealed record, or whose content does not match its own hash."""


def rotated_name(first_seq: int, attempt: int = 0) -> str:
    """The name a rotated file gets: sortable by the seq of its first record."""
    return f"audit-{first_seq:012d}.jsonl" if attempt == 0 else f"audit-{first_seq:012d}-{attempt}.jsonl"


def rotated_seq(name: str) -> int | None:
    """The first seq a rotated file's name carries, or None for a name that is not a rotated file."""
    match = ROTATED_RE.match(name)
    return int(match.group(1)) if match else None


def audit_files(directory: Path) -> list[Path]:
    """The audit files in ``directory``, oldest first (rotated by seq, then the current file)."""
    rotated = [(seq, p.name, p) for p in directory.iterdir() if (seq := rotated_seq(p.name)) is not None]
    files = [p for _, _, p in sorted(rotated)]
    current = directory / CURRENT_NAME
    if current.exists():
        files.append(current)
    return files


def seal(record: dict[str, Any]) -> tuple[bytes, str]:
    """The line (newline included) for ``record`` (which carries ``seq`` .. ``prev``, all
    JSON-ready, no ``hash``) and its hash. Raises ValueError for a value JSON cannot hold (the
    caller bounds values first, see fields.py)."""
    body = json.dumps(record, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii")
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + b',"hash":"' + digest.encode("ascii") + b'"}\n', digest


def unseal(line: bytes) -> dict[str, Any]:
    """The record a line (without its newline) holds, after checking that it is one: JSON ending
    in its ``hash``, content matching that hash, an integer ``seq``, a string ``event`` and a
    64-hex ``prev``. Raises :class:`BrokenRecord` saying what is wrong."""
    match = _SUFFIX_RE.search(line)
    if match is None:
        raise BrokenRecord("not a sealed audit record (no trailing hash)")
    body = line[: match.start()] + b"}"
    if hashlib.sha256(body).hexdigest() != match.group(1).decode():
        raise BrokenRecord("its content does not match its own hash: the line was changed after it was written")
    try:
        record = json.loads(line)
    except ValueError as err:
        raise BrokenRecord(f"not valid JSON ({err})") from None
    if not isinstance(record, dict):
        raise BrokenRecord("not a JSON object")
    seq, prev = record.get("seq"), record.get("prev")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise BrokenRecord("no valid seq")
    if not isinstance(prev, str) or not _HEX64_RE.match(prev):
        raise BrokenRecord("no valid prev")
    if not isinstance(record.get("event"), str):
        raise BrokenRecord("no event")
    return record
