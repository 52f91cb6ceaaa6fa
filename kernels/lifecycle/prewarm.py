"""Pre-warming a pooled kernel: import the operator's data stack before a session is handed out.

STUB (issue 17, owned by helper H1): the interface below is fixed; the body is H1's.
"""

from __future__ import annotations

from collections.abc import Sequence

from sandkernel.kernels.execution.session import KernelSession


def validate_modules(modules: Sequence[str]) -> tuple[str, ...]:
    """The module names to preload, checked (dotted Python identifiers only; empty strings
    dropped); ConfigError for anything else."""
    return tuple(m for m in modules if m)


async def prewarm(session: KernelSession, modules: Sequence[str]) -> None:
    """Import ``modules`` in the session's kernel, silently: no cell, no output, no execution
    count, no name left in the user namespace. Raises SandkernelError if the kernel fails."""
    return None
