"""``sandkernel audit verify``: check an audit log's hash chain and name the first record at fault.

Checked, record by record across the files given (ordered by their first seq, so a shell glob
in any order works; a directory means every audit file in it): each line is a sealed record
whose content matches its own ``hash``; ``seq`` goes up by one; ``prev`` is the ``hash`` of the
record before. A damaged tail that a later ``chain_resumed`` record accounts for (its offset,
size and SHA-256, see log.py) is reported as a note, not a fault: the gateway crashed mid-write
and said so. Anything else stops the check at the first line at fault: file, line, seq, why.

What a chain cannot show on its own (say so to operators): a log cut off at the end (the
remaining records still form an intact chain), or a log rewritten from some point on with every
hash recomputed. Both need an anchor kept outside the log's directory: the head hash that this
command prints, and that the gateway logs at every rotation and at shutdown. ``--anchor HASH``
then checks that the record with that hash is still in the chain: everything up to it is as it
was when the anchor was taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from sandkernel.gateway.audit.chain import GENESIS, BrokenRecord, audit_files, rotated_seq, unseal


@dataclasses.dataclass(frozen=True)
class Fault:
    """The first line at fault: file, line number (1-based), its seq when readable, and why."""

    file: str
    line: int
    seq: int | None
    reason: str

    def __str__(self) -> str:
        seq = f"seq {self.seq}" if self.seq is not None else "seq unreadable"
        return f"{self.file}:{self.line} ({seq}): {self.reason}"


@dataclasses.dataclass
class Report:
    """What :func:`verify` found. ``ok`` when no fault and every anchor was met."""

    files: list[str] = dataclasses.field(default_factory=list)
    records: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    head: str | None = None  # the last intact record's hash: the anchor to keep elsewhere
    fault: Fault | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    missing_anchors: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.fault is None and not self.missing_anchors

    def summary(self) -> str:
        span = f"seq {self.first_seq}..{self.last_seq}" if self.records else "no records"
        where = f"{self.records} records ({span}) in {len(self.files)} file(s)"
        lines = [f"note: {note}" for note in self.notes]
        if self.fault is not None:
            lines.append(f"chain BROKEN at {self.fault}")
            lines.append(f"{where} before it are intact; last intact head {self.head}")
        else:
            lines.append(f"{where}, chain intact, head {self.head} (seq {self.last_seq})")
        missing = "NOT in the chain: records up to it were removed or rewritten"
        lines += [f"anchor {a} {missing}" for a in self.missing_anchors]
        return "\n".join(lines)


@dataclasses.dataclass
class _Damage:
    file: str
    line: int
    offset: int
    size: int
    sha256: str
    seq: int | None
    reason: str

    def accounted_by(self, record: dict[str, Any]) -> bool:
        said = record.get("damaged_tail")
        return (
            record.get("event") in ("chain_resumed", "chain_started")
            and isinstance(said, dict)
            and said.get("file") == Path(self.file).name
            and said.get("offset") == self.offset
            and said.get("bytes") == self.size
            and said.get("sha256") == self.sha256
        )


def _order(paths: list[Path]) -> list[Path]:
    """Files oldest first: by the seq of their first record (else the seq in their name)."""

    def key(item: tuple[int, Path]) -> tuple[float, int]:
        index, path = item
        try:
            with path.open("rb") as f:
                return (unseal(f.readline().rstrip(b"\n"))["seq"], index)
        except (OSError, BrokenRecord):
            seq = rotated_seq(path.name)
            return (seq if seq is not None else float("inf"), index)

    return [p for _, p in sorted(enumerate(paths), key=key)]


def _expand(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        files.extend(audit_files(path) if path.is_dir() else [path])
    return files


def _seq_of(line: bytes) -> int | None:
    try:
        seq = json.loads(line).get("seq")
    except (ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) else None


def verify(paths: list[Path], anchors: tuple[str, ...] = ()) -> Report:
    """Check the chain through ``paths`` (files or audit directories). Raises OSError for a file
    that cannot be read; everything wrong inside the files is in the report."""
    files = _order(_expand([Path(p) for p in paths]))
    report = Report(files=[str(f) for f in files])
    wanted = set(anchors)
    last: tuple[int, str, str, int] | None = None  # seq, hash, file, line of the last intact record
    damage: _Damage | None = None
    for path in files:
        data = path.read_bytes()
        offset, number = 0, 0
        while offset < len(data):
            number += 1
            end = data.find(b"\n", offset)
            line = data[offset:] if end < 0 else data[offset:end]
            try:
                if end < 0:
                    raise BrokenRecord("the line is incomplete (no newline): a write cut short, or a truncated file")
                record = unseal(line)
            except BrokenRecord as err:
                rest = data[offset:]
                sha = hashlib.sha256(rest).hexdigest()
                damage = _Damage(str(path), number, offset, len(rest), sha, _seq_of(line), str(err))
                break  # the rest of this file is a damaged tail, if a later record accounts for it
            seq = record["seq"]
            if damage is not None:
                if not damage.accounted_by(record):
                    report.fault = Fault(damage.file, damage.line, damage.seq, damage.reason)
                    return report
                report.notes.append(
                    f"{damage.file}:{damage.line}: a damaged tail of {damage.size} bytes ({damage.reason}), "
                    f"set aside and recorded by seq {seq} ({path}:{number})"
                )
                damage = None
            elif isinstance(record.get("damaged_tail"), dict):  # damage in a file not given (or unreadable)
                said = record["damaged_tail"]
                report.notes.append(
                    f"seq {seq} ({path}:{number}) records damage set aside in {said.get('file')} "
                    f"({said.get('bytes')} bytes, sha256 {said.get('sha256')}), a file not checked here"
                )
            fault = _link_fault(last, record)
            if fault is not None:
                report.fault = Fault(str(path), number, seq, fault)
                return report
            if last is None and seq > 0:
                report.notes.append(
                    f"the chain starts at seq {seq} (prev {record['prev']}): earlier records were rotated away "
                    "or not given"
                )
            last = (seq, record["hash"], str(path), number)
            wanted.discard(record["hash"])
            report.records += 1
            report.first_seq = seq if report.first_seq is None else report.first_seq
            report.last_seq, report.head = seq, record["hash"]
            offset = end + 1
    if damage is not None:
        report.fault = Fault(damage.file, damage.line, damage.seq, damage.reason)
    report.missing_anchors = sorted(wanted)
    return report


def _link_fault(last: tuple[int, str, str, int] | None, record: dict[str, Any]) -> str | None:
    """Why ``record`` does not follow ``last`` (None: it does)."""
    seq, prev = record["seq"], record["prev"]
    if last is None:
        if seq == 0 and prev != GENESIS:
            return "the first record of a log (seq 0) must have prev 0…0"
        return None
    last_seq, last_hash, last_file, last_line = last
    if seq != last_seq + 1:
        if seq > last_seq + 1:
            gone = seq - last_seq - 1
            return f"seq {seq} follows seq {last_seq}: {gone} record(s) before this line were deleted or moved"
        return f"seq {seq} follows seq {last_seq}: records out of order (moved or replayed)"
    if prev != last_hash:
        return (
            f"prev does not match the hash of the record before it ({last_file}:{last_line}, seq {last_seq}): "
            "that record was rewritten (its hash recomputed), or this one's prev was"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """``sandkernel audit verify FILE|DIR [...] [--anchor HASH]``: 0 when the chain is intact (and
    every anchor is in it), 1 when it is not, 2 when a file cannot be read."""
    parser = argparse.ArgumentParser(
        prog="sandkernel audit verify",
        description="Check an audit log's hash chain; name the first record at fault.",
    )
    parser.add_argument("paths", nargs="+", type=Path, metavar="FILE", help="audit files, or an audit directory")
    parser.add_argument(
        "--anchor",
        action="append",
        default=[],
        metavar="HASH",
        help="a head hash kept elsewhere (printed by this command, logged by the gateway at rotation and "
        "shutdown): fail unless that record is still in the chain",
    )
    args = parser.parse_args(argv)
    try:
        report = verify(args.paths, tuple(a.strip().lower() for a in args.anchor))
    except OSError as err:
        print(f"cannot read the audit log: {err}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0 if report.ok else 1
