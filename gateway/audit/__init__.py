"""The audit stream (issue 15): a per-gateway, append-only, rotated, hash-chained JSON Lines log
of every change of state, and ``sandkernel audit verify`` to check it.

chain.py: the line format and file names; fields.py: what a record may hold (bounded, escaped);
log.py: the writer (off the event loop, in order, never raising into a request); observer.py:
the session observer; verify.py: the checker and its command line.
"""
