"""The audit stream (issue 15): a per-gateway, append-only, rotated, hash-chained JSON Lines log
of every change of state, and ``sandkernel audit verify`` to check it.

chain.py: the line format and file names; fields.py: what a record may hold (bounded, escaped);
files.py: the directory and reading it back; log.py: the writer (off the event loop, in order,
never raising into a request); retention.py: what the directory keeps (by age, within a disk
budget) and who holds it; usage.py: each tenant's bytes in the last minute; gate.py: the gate
that holds back a tenant the log cannot keep up with; observer.py: the session observer;
verify.py: the checker and its command line.
"""
