"""Pre-warming a pooled kernel: import the operator's data stack before a session is handed out.

Why: an agent's first cell is rarely ``1+1``; it is ``import pandas as pd; pd.read_csv(...)``,
and importing numpy, pandas and matplotlib costs about a second in every fresh sandbox (more
under gVisor; matplotlib also builds its font cache in the tmpfs MPLCONFIGDIR at first import).
A pooled sandbox has no user yet, so it pays that before handout and the first cell costs what
it costs in a warm kernel. Sessions of other profiles start cold and are not pre-warmed.

What the user must not be able to tell, apart from the speed (tests/test_prewarm.py):

- no cell and no execution count: one ``execute_request`` with ``silent=True`` and
  ``store_history=False``, so IPython counts nothing and writes nothing to ``In``/``Out``/``_ih``
  or its history, and publishes no ``execute_input``/``execute_result``;
- no name in the user namespace: each import is a ``user_expressions`` entry whose value is the
  module's name (``importlib.import_module(...).__name__``); an expression binds nothing;
- nothing recorded: the request goes over a short-lived shell connection of its own, not
  through :meth:`KernelSession.execute`, so no observer (transcript, metrics, audit) hears of
  it; the connection has its own Jupyter session id, so whatever an import prints on iopub is
  discarded by the session's drain without being counted as the session's output (which would
  put an "output after the cell returned" note in the user's transcript).

A module that fails to import fails the sandbox (the pool removes it, logs the error and
retries), with a message naming the module; a module that hangs fails it after ``timeout``.
Module names are checked before any sandbox starts: dotted identifiers only, never code.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Sequence
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient

from sandkernel.errors import ConfigError, KernelStartError
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.kernels.execution.transport import next_message

# The longest an error detail from the kernel may run in our message (its text is untrusted-ish
# and a traceback can be long; the name of the module and the exception's first words suffice).
MAX_DETAIL_CHARS = 300


def validate_modules(modules: Sequence[str]) -> tuple[str, ...]:
    """The module names to preload, checked (dotted Python identifiers only; empty strings
    dropped); ConfigError for anything else.

    The names end up inside an expression the kernel evaluates: only a name that is a dotted
    identifier, passed as a quoted string, can never be anything but a module name there."""
    if isinstance(modules, str):  # a lone string would be taken letter by letter
        raise ConfigError(f"pool_preload must be a list of module names, not the string {modules!r}")
    names: list[str] = []
    for name in modules:
        if not isinstance(name, str):
            raise ConfigError(f"pool_preload: a module name must be a string, not {name!r}")
        name = name.strip()
        if not name:
            continue
        if not all(part.isidentifier() and part.isascii() for part in name.split(".")):
            raise ConfigError(f"pool_preload: {name!r} is not a module name (dotted Python identifiers only)")
        if name not in names:
            names.append(name)
    return tuple(names)


# Evaluated after the imports: collect once, then freeze what survives (the imported modules,
# ~100k objects) into the permanent generation. Without it the user's first cell paid for the
# first full collection walking all of them (~70 ms on a loaded 2-core host, measured), and every
# later full collection walked them again; frozen objects are the imports, which live as long as
# the kernel anyway. The key is no module name (it has a space), so it never collides.
GC_FREEZE = ("collect and freeze", "[__import__('gc').collect(), __import__('gc').freeze()][0]")


def _import_expression(module: str) -> str:
    """What the kernel evaluates to import ``module``: its value is the name, and it binds none."""
    return f"__import__('importlib').import_module({module!r}).__name__"


async def prewarm(session: KernelSession, modules: Sequence[str], *, timeout: float | None = None) -> None:
    """Import ``modules`` in the session's kernel, silently: no cell, no output, no execution
    count, no name left in the user namespace. Raises SandkernelError if the kernel fails.

    ``timeout``: seconds for all the imports (default: the profile's ``start_timeout``, as the
    pre-warm is part of getting the sandbox ready). On KernelStartError the kernel may still be
    busy importing: the caller removes the sandbox."""
    names = validate_modules(modules)
    if not names:
        return
    limit = session.profile.start_timeout if timeout is None else timeout
    km = session.kernel_manager
    own = km.session.clone()
    own.session = uuid.uuid4().hex  # not the session's id: its drain does not count our output
    client = km.client(context=km.context, session=own)
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    started = time.monotonic()
    try:
        async with session.exclusive():
            msg_id = client.execute(
                "",
                silent=True,
                store_history=False,
                user_expressions={**{name: _import_expression(name) for name in names}, GC_FREEZE[0]: GC_FREEZE[1]},
                allow_stdin=False,
                stop_on_error=False,
            )
            reply = await _reply(client, msg_id, started + limit, session.id)
    finally:
        client.stop_channels()
    if reply is None:
        raise KernelStartError(f"preloading {', '.join(names)} did not finish within {limit:g}s (a module that hangs?)")
    _check(reply, names)


async def _reply(client: AsyncKernelClient, msg_id: str, deadline: float, session_id: str) -> dict[str, Any] | None:
    """The content of ``msg_id``'s execute_reply on our shell, or None by the deadline."""
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            msg = await next_message(client, "shell", remaining, session_id)
        except queue.Empty:
            return None
        if msg.get("parent_header", {}).get("msg_id") == msg_id:
            return msg["content"]
    return None


def _check(reply: dict[str, Any], names: tuple[str, ...]) -> None:
    """Raise KernelStartError naming every module whose import failed."""
    if reply.get("status") != "ok":
        detail = f"{reply.get('ename', 'no reply')}: {reply.get('evalue', '')}"[:MAX_DETAIL_CHARS]
        raise KernelStartError(f"preloading {', '.join(names)} failed in the kernel ({detail})")
    results = reply.get("user_expressions") or {}
    failed = []
    for name in names:
        found = results.get(name) or {}
        if found.get("status") != "ok":
            detail = f"{found.get('ename', 'no result')}: {found.get('evalue', '')}"[:MAX_DETAIL_CHARS]
            failed.append(f"{name} ({detail})")
    if failed:
        raise KernelStartError(f"the pooled kernel could not preload {'; '.join(failed)}")
